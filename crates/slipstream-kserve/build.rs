//! Generate the protocol's Rust types and the tonic service from
//! `proto/grpc_predict_v2.proto` at build time.
//!
//! `protoc` comes from the `protoc-bin-vendored` crate rather than the
//! system: fresh machines and wheel builds have none, and a vendored one
//! keeps the generated code the same everywhere. `bytes` fields become
//! `bytes::Bytes`, so that a tensor's raw contents are a slice of the
//! received buffer rather than a copy of it.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc);
    config.bytes(["."]);
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        // The generated client's `connect` needs tonic's transport; callers
        // bring their own channel.
        .build_transport(false)
        .compile_with_config(config, &["proto/grpc_predict_v2.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto/grpc_predict_v2.proto");
    Ok(())
}
