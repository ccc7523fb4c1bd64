//! Bakes an rpath to libtorch into the binaries so that `cadenza` runs without
//! LD_LIBRARY_PATH, and compiles the crate's C++ kernels,
//! `src/model/spe_filter.cpp`, `src/model/favor_attention.cpp` and
//! `src/model/rope.cpp` (libtorch
//! autograd functions: `tch` has no way to define one in Rust), against the
//! same libtorch headers and C++ ABI as torch-sys. `DEP_TCH_LIBTORCH_LIB` is exported by torch-sys (links = "tch")
//! and reaches this crate because it depends on torch-sys directly.
use std::path::Path;

/// The kernels (see their files' headers) with the flags torch-sys uses
/// for its own C++ (C++ ABI, PIC), optimized, and with float reassociation so
/// that its dot products vectorize (the file says where that moves the floats).
fn compile_kernels(lib: &Path) {
    let sources = [
        "src/model/spe_filter.cpp",
        "src/model/favor_attention.cpp",
        "src/model/rope.cpp",
    ];
    for src in sources.iter().chain(&["src/model/kernels.h"]) {
        println!("cargo:rerun-if-changed={src}");
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    let include = lib.parent().map(|p| p.join("include")).unwrap_or_default();
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .opt_level(3)
        .flag("-fno-math-errno")
        .flag("-fassociative-math")
        .flag("-fno-signed-zeros")
        .flag("-fno-trapping-math")
        .flag("-ffp-contract=fast")
        // at::parallel_for is a header template over `#pragma omp parallel`
        // (libtorch's OpenMP backend): without -fopenmp it runs serially
        .flag("-fopenmp")
        // (GCC notes that passing 64-byte vectors by value changed ABI in 4.6)
        .flag("-Wno-psabi")
        .files(sources)
        .compile("cadenza_kernels");
    // after the static library, so that its references to libtorch resolve
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}

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
    let venv = Path::new(&manifest).join(".venv");
    let stamp = venv.join(".cadenza-torch-2.13.0-cuda");
    // scripts/setup-libtorch.sh leaves one stamp, -cpu or -cuda, and removes the other:
    // watch the one there (a path that does not exist would make cargo rerun this
    // script, and rebuild the crate and its C++, at every invocation)
    let cpu = venv.join(".cadenza-torch-2.13.0-cpu");
    if let Some(there) = [&stamp, &cpu].into_iter().find(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", there.display());
    }
    stamp.exists() && lib.join("libtorch_cuda.so").exists()
}

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let lib = std::env::var("DEP_TCH_LIBTORCH_LIB")
        .expect("torch-sys exports DEP_TCH_LIBTORCH_LIB (links = \"tch\")");
    compile_kernels(Path::new(&lib));
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    // A CUDA libtorch registers its kernels from libtorch_cuda.so, which the
    // linker would drop as unused without --no-as-needed.
    if wants_cuda(Path::new(&lib)) {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-ltorch");
    }
}
