//! Generates the fakes' gRPC APIs:
//! - the server side of SPIRE's Delegated Identity API (the `spire-api` crate ships only
//!   a client) for the fake SPIRE agent; messages are `spire_api`'s types.
//! - both sides of the X.509 half of the SPIFFE Workload API
//!   (`proto/spiffe/workload.proto`, restated from the specification): the server for
//!   the fake Workload API, the client to probe it the way a careless caller would (the
//!   `spiffe` crate's client always sends the security header).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .extern_path(".spire.api.types", "::spire_api::pb::spire::api::types")
        .extern_path(
            ".spire.api.agent.delegatedidentity.v1",
            "::spire_api::pb::spire::api::agent::delegatedidentity::v1",
        )
        .compile_with_config(
            config,
            &["proto/spire/api/agent/delegatedidentity/v1/delegatedidentity.proto"],
            &["proto"],
        )?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &["proto/spiffe/workload.proto"], &["proto"])?;
    Ok(())
}
