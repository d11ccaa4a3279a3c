fn main() {
    println!("{}", kube_proxy_ebpf::ebpf_object::EBPF_OBJECT.len());
}
