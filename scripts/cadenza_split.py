"""cadenza's held-out split, for the Python scripts that must pick the pieces a model
never trained on (scripts/form/heldout-folk.py, scripts/reference/train_ref.py).
No dependencies beyond the standard library."""

U64 = (1 << 64) - 1


def is_validation(source, seed, fraction):
    """cadenza's data::is_validation (src/train/data.rs): FNV-1a 64 over the UTF-8 bytes of the
    source name, its offset basis xor-ed with seed * 0x9e3779b97f4a7c15 (wrapping u64), then the
    top 53 bits as a fraction of 2^53, held out when that is <= `fraction`."""
    h = 0xCBF29CE484222325 ^ ((seed * 0x9E3779B97F4A7C15) & U64)
    for b in source.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & U64
    return (h >> 11) / float(1 << 53) <= fraction
