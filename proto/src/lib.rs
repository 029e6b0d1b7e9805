//! Aether's own gRPC APIs, generated from `proto/` by tonic-prost-build.

pub mod codec;
pub mod digest;

pub mod cni {
    pub mod v1 {
        tonic::include_proto!("aether.cni.v1");
    }
}

pub mod registry {
    pub mod v1 {
        tonic::include_proto!("aether.registry.v1");
    }
}

pub mod registrar {
    pub mod v1 {
        tonic::include_proto!("aether.registrar.v1");
    }
}

pub mod view;
