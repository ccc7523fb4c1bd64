//! The memory allocator of every binary that links this crate: jemalloc,
//! made the allocator of the whole process (`malloc` itself, so libtorch's
//! C++ allocations use it too), built to keep the pages it frees
//! (`dirty_decay_ms:-1,muzzy_decay_ms:-1`) and to reuse a kept extent for a
//! request however much smaller (`lg_extent_max_active_fit:16`; the default,
//! 6, only reuses extents up to 64 times the request), both set in
//! `.cargo/config.toml`.
//!
//! Why: a training step frees and allocates again tensors of tens to
//! hundreds of MB. glibc's malloc hands every block over 32 MB back to the
//! system and takes fresh zeroed pages for the next one, so each step paid
//! for page faults (two libtorch threads contending in the kernel): a third
//! of the step at L = 4,096, batch 8. With jemalloc keeping its pages,
//! measured with `benches/train_speed.rs` on 2 threads: 4,100 -> 5,950
//! tokens/s at L = 4,096 (batch 8) and 2,840 -> 4,800 at L = 16,384 (batch
//! 2), the same at L = 512; peak memory no higher. The price: memory freed
//! by a process stays with it until it exits (a training run's footprint is
//! its peak anyway).
//!
//! Why the second option: with the default fit, a step at L = 16,384 (batch
//! 2) kept asking the system for fresh pages (8% of the step in the kernel
//! zeroing them, and a peak that grew from step to step), because the extents
//! it had kept were too large to be reused for its smaller tensors. Measured
//! with `benches/train_speed.rs` (shipped shape, 2 threads, the built-in
//! setting against `MALLOC_CONF=lg_extent_max_active_fit:6` in the same
//! build, three alternations): 4,092 -> 4,652 tokens/s and 7,870 -> 5,968 MB
//! peak at L = 16,384; the same at 2,048 (5,354 and 5,288 tokens/s, 2,781 MB).
//!
//! The libtorch-free `cadenza` binary does not link this crate and keeps the
//! system allocator.

#[cfg(all(unix, not(target_env = "musl")))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
