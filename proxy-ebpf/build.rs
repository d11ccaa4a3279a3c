use which::which;

/// Rebuild the eBPF object when bpf-linker changes (a new linker can emit different BTF).
fn main() {
    if let Ok(linker) = which("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }
}
