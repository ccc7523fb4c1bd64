//! Bakes an rpath to libtorch into the binaries so that `cadenza` runs without
//! LD_LIBRARY_PATH. `DEP_TCH_LIBTORCH_LIB` is exported by torch-sys (links = "tch")
//! and reaches this crate because it depends on torch-sys directly.
use std::path::Path;

/// Link CUDA only for a full (CUDA) torch install: the slim CPU install also
/// ships libtorch_cuda.so, but without the CUDA libraries it needs.
fn wants_cuda(lib: &Path) -> bool {
    println!("cargo:rerun-if-env-changed=CADENZA_CUDA");
    match std::env::var("CADENZA_CUDA").as_deref() {
        Ok("1") => return true,
        Ok("0") => return false,
        _ => {}
    }
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let stamp = Path::new(&manifest).join(".venv/.cadenza-torch-2.13.0-cuda");
    println!("cargo:rerun-if-changed={}", stamp.display());
    stamp.exists() && lib.join("libtorch_cuda.so").exists()
}

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        // A CUDA libtorch registers its kernels from libtorch_cuda.so, which the
        // linker would drop as unused without --no-as-needed.
        if wants_cuda(Path::new(&lib)) {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-ltorch_cuda");
            println!("cargo:rustc-link-arg=-ltorch");
        }
    }
}
