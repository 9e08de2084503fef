//! Finds libfabric's library directory when the `libfabric` feature is on, so this crate's
//! tests and examples run without LD_LIBRARY_PATH (an rpath), and dependents that link a
//! final artifact (the JNI library) can read it as `DEP_RDMA_SHUFFLE_OFI_LIBDIR`.
//!
//! `ofi-libfabric-sys` finds libfabric through pkg-config; the same search is made here, so
//! `PKG_CONFIG_PATH=$(bash scripts/ensure-libfabric.sh)/lib/pkgconfig` serves both.

fn main() {
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    if std::env::var_os("CARGO_FEATURE_LIBFABRIC").is_none() {
        return;
    }
    match pkg_config::Config::new().atleast_version("2.0").cargo_metadata(false).probe("libfabric") {
        Ok(lib) => {
            for dir in &lib.link_paths {
                println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
            }
            if let Some(dir) = lib.link_paths.first() {
                println!("cargo:libdir={}", dir.display());
            }
        }
        Err(e) => panic!(
            "the libfabric feature needs libfabric >= 2.0 found by pkg-config ({e}); build it \
             once with scripts/ensure-libfabric.sh and set \
             PKG_CONFIG_PATH=<the prefix it prints>/lib/pkgconfig"
        ),
    }
}
