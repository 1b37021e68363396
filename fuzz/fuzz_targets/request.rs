#![no_main]

mod targets {
    include!("../targets.rs");
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| targets::request(data));
