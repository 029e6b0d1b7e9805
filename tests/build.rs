//! Generates the server side of SPIRE's Delegated Identity API (the `spire-api` crate
//! ships only a client) for the fake SPIRE agent; messages are `spire_api`'s types.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/spire/api/agent/delegatedidentity/v1/delegatedidentity.proto";
    println!("cargo:rerun-if-changed=proto");
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .extern_path(".spire.api.types", "::spire_api::pb::spire::api::types")
        .extern_path(
            ".spire.api.agent.delegatedidentity.v1",
            "::spire_api::pb::spire::api::agent::delegatedidentity::v1",
        )
        .compile_with_config(config, &[proto], &["proto"])?;
    Ok(())
}
