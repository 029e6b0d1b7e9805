//! Reading Envoy's admin answers (`/clusters?format=json`, `/server_info`) into the few
//! facts the debug API reports. Pure: the bodies in, facts out.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::explain::Host;

/// Hosts per cluster name, from `/clusters?format=json`.
pub fn hosts(body: &str) -> BTreeMap<String, Vec<Host>> {
    let Ok(json) = serde_json::from_str::<Value>(body) else {
        return BTreeMap::new();
    };
    let clusters = json["cluster_statuses"].as_array().into_iter().flatten();
    clusters
        .map(|c| {
            let hosts = c["host_statuses"].as_array().into_iter().flatten().map(host).collect();
            (c["name"].as_str().unwrap_or_default().to_owned(), hosts)
        })
        .collect()
}

fn host(h: &Value) -> Host {
    let address = &h["address"];
    let address = match (&address["socket_address"], &address["envoy_internal_address"]) {
        (Value::Object(s), _) => format!(
            "{}:{}",
            s.get("address").and_then(Value::as_str).unwrap_or_default(),
            s.get("port_value").and_then(Value::as_u64).unwrap_or_default()
        ),
        (_, Value::Object(i)) => i
            .get("endpoint_id")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => address.to_string(),
    };
    let health = &h["health_status"];
    let eds = health["eds_health_status"].as_str().unwrap_or("HEALTHY");
    let flag = |name: &str| health[name].as_bool().unwrap_or(false);
    Host {
        address,
        healthy: matches!(eds, "HEALTHY" | "UNKNOWN") && !flag("failed_active_health_check"),
        ejected: flag("failed_outlier_check"),
    }
}

/// What `/server_info` says, for `aether status`.
#[derive(Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Server {
    pub state: String,
    /// The release (`1.40.0`), from Envoy's `<sha>/<release>/<status>/<type>/<tls>` version.
    pub version: String,
    pub epoch: u64,
    pub uptime_seconds: u64,
}

pub fn server(body: &str) -> Option<Server> {
    let json: Value = serde_json::from_str(body).ok()?;
    let number = |v: &Value| v.as_u64().or_else(|| v.as_str()?.parse().ok()).unwrap_or_default();
    let full = json["version"].as_str().unwrap_or_default();
    Some(Server {
        state: json["state"].as_str()?.to_owned(),
        version: full.split('/').nth(1).unwrap_or(full).to_owned(),
        epoch: number(&json["command_line_options"]["restart_epoch"]),
        // A protobuf Duration in JSON: "42.5s".
        uptime_seconds: json["uptime_current_epoch"]
            .as_str()
            .and_then(|s| s.trim_end_matches('s').split('.').next()?.parse().ok())
            .unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_carry_their_health_and_ejection() {
        let body = r#"{"cluster_statuses":[{"name":"backend.demo.aether.internal:8080","host_statuses":[
            {"address":{"envoy_internal_address":{"server_listener_name":"originate","endpoint_id":"10.0.0.2:8080"}},
             "health_status":{"eds_health_status":"HEALTHY"}},
            {"address":{"socket_address":{"address":"10.0.0.3","port_value":8080}},
             "health_status":{"eds_health_status":"HEALTHY","failed_outlier_check":true}},
            {"address":{"socket_address":{"address":"10.0.0.4","port_value":8080}},
             "health_status":{"eds_health_status":"UNHEALTHY"}}]}]}"#;
        let hosts = hosts(body);
        let got: Vec<_> = hosts["backend.demo.aether.internal:8080"]
            .iter()
            .map(|h| (h.address.as_str(), h.healthy, h.ejected))
            .collect();
        assert_eq!(
            got,
            [
                ("10.0.0.2:8080", true, false),
                ("10.0.0.3:8080", true, true),
                ("10.0.0.4:8080", false, false)
            ]
        );
        assert!(super::hosts("not json").is_empty());
    }

    #[test]
    fn server_info_gives_state_release_and_epoch() {
        let body = r#"{"version":"abc/1.40.0/Clean/RELEASE/BoringSSL","state":"LIVE",
            "command_line_options":{"restart_epoch":2},"uptime_current_epoch":"42.5s"}"#;
        assert_eq!(
            server(body),
            Some(Server {
                state: "LIVE".into(),
                version: "1.40.0".into(),
                epoch: 2,
                uptime_seconds: 42
            })
        );
    }
}
