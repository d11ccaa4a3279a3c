#![no_std]
#![no_main]

use aya_ebpf::{macros::classifier, programs::TcContext};

#[classifier]
pub fn tc_ingress(_ctx: TcContext) -> i32 {
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
