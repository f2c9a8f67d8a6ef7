//! Compile proto/tandem/v1/tandem.proto with protox (pure Rust: no protoc on the machine).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("tandem/v1/tandem.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
