//! Compiles our protos with a vendored protoc, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "proto/aether/cni/v1/cni.proto",
        "proto/aether/registry/v1/authorization.proto",
        "proto/aether/registry/v1/http_filter.proto",
        "proto/aether/registry/v1/mesh_config.proto",
        "proto/aether/registry/v1/registry.proto",
        "proto/aether/registry/v1/route.proto",
        "proto/aether/registrar/v1/registrar.proto",
    ];
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Sorted maps encode the same on every side, so a message's digest (`digest.rs`) is
    // the same wherever it is computed.
    config.btree_map(["."]);
    // Most services are not external: keep every Service small.
    config.boxed(".aether.registry.v1.Service.external");
    tonic_prost_build::configure()
        .codec_path("crate::codec::SmallBuffers")
        .compile_with_config(config, &protos, &["proto"])?;
    Ok(())
}
