#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| tandem_fuzz::verifier_stream(data));
