//! The mesh's settings as this node holds them (proposals/016): the MeshConfigs its Watch
//! stream carries (the mesh-wide one, those of its pods' namespaces and of its
//! dependencies' namespaces), valid ones only, read through
//! `aether_api::mesh_config::effective`, the one function that decides a namespace's
//! settings. A record failing `validate` (a bad store) is skipped and counted: the
//! namespace falls back to the mesh-wide settings, then the built-in ones.

use std::collections::BTreeMap;
use std::sync::Arc;

use aether_api::mesh_config::{Settings, effective, validate};
use aether_proto::registry::v1::MeshConfig;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct MeshSettings {
    valid: Vec<Arc<MeshConfig>>,
    invalid: usize,
}

impl MeshSettings {
    /// The valid ones among `configs` (a catalog view's, by key).
    pub fn new(configs: &BTreeMap<String, Arc<MeshConfig>>) -> Self {
        let (valid, invalid): (Vec<_>, Vec<_>) = configs.values().cloned().partition(|c| validate(c).is_ok());
        MeshSettings {
            valid,
            invalid: invalid.len(),
        }
    }

    /// The settings of `namespace`.
    pub fn of(&self, namespace: &str) -> Settings {
        effective(self.valid.iter().map(|c| &**c), namespace)
    }

    /// The settings where no namespace is known (a service asked for on demand): the
    /// mesh-wide ones.
    pub fn mesh(&self) -> Settings {
        effective(self.valid.iter().filter(|c| c.mesh_wide).map(|c| &**c), "")
    }

    /// MeshConfigs skipped because they fail validation.
    pub fn invalid(&self) -> usize {
        self.invalid
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aether_api::pod::InboundMtls;
    use aether_proto::registry::v1::{InboundMtlsMode, Resilience};

    fn config(namespace: &str, mesh_wide: bool, mode: InboundMtlsMode, attempts: u32) -> (String, Arc<MeshConfig>) {
        let config = MeshConfig {
            namespace: namespace.into(),
            name: "default".into(),
            mesh_wide,
            inbound_mtls: mode.into(),
            resilience: Some(Resilience {
                retry_attempts: Some(attempts),
                ..Default::default()
            }),
            ..Default::default()
        };
        (format!("{namespace}/default"), Arc::new(config))
    }

    #[test]
    fn an_invalid_record_is_skipped_and_counted() {
        let mut configs = BTreeMap::from([
            config("aether-system", true, InboundMtlsMode::Permissive, 1),
            config("shop", false, InboundMtlsMode::Strict, 0),
        ]);
        let settings = MeshSettings::new(&configs);
        assert_eq!(settings.of("shop").inbound_mtls, Some(InboundMtls::Strict));
        assert_eq!(settings.of("web").inbound_mtls, Some(InboundMtls::Permissive));
        assert_eq!(settings.mesh().resilience.retry_attempts, 1);
        assert_eq!(settings.invalid(), 0);

        // A store handed over a retry count out of range: shop falls back to the mesh's.
        Arc::make_mut(configs.get_mut("shop/default").unwrap()).resilience = Some(Resilience {
            retry_attempts: Some(99),
            ..Default::default()
        });
        let settings = MeshSettings::new(&configs);
        assert_eq!(settings.invalid(), 1);
        assert_eq!(settings.of("shop").resilience.retry_attempts, 1);
        assert_eq!(settings.of("shop").inbound_mtls, Some(InboundMtls::Permissive));
    }
}
