//! The real `aether-mesh-dns` binary, asked with `dig`, forwarding to a real `unbound`.

mod support;

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use support::*;

const A: u16 = 1;
const IN: u16 = 1;

fn mesh_records() -> Vec<(&'static str, &'static str, aether_mesh_dns::records::Addresses)> {
    vec![
        ("shop", "cart", dual([240, 240, 0, 9], "fd00::9")),
        ("default", "web", v4([240, 240, 0, 7])),
    ]
}

/// unbound answering `www.fwd.test` and, with `max-udp-size: 512`, truncating `big.test` TXT over UDP.
fn upstream() -> Unbound {
    let mut lines = vec![
        "local-zone: \"test.\" static".to_owned(),
        "local-data: \"www.fwd.test. 60 IN A 192.0.2.1\"".to_owned(),
        "local-data: \"cart.shop.aether.internal. 60 IN A 192.0.2.66\"".to_owned(),
        "local-data: \"cart.shop.aether.internal.svc.cluster.local. 60 IN A 192.0.2.67\"".to_owned(),
        // Its own OPT size, to see that the upstream's EDNS answer reaches the client.
        "edns-buffer-size: 1400".to_owned(),
        "max-udp-size: 512".to_owned(),
    ];
    for i in 0..30 {
        lines.push(format!(
            "local-data: 'big.test. 60 IN TXT \"record-{i:02}-{}\"'",
            "x".repeat(80)
        ));
    }
    Unbound::start(&lines)
}

fn upstream_arg(unbound: &Unbound) -> String {
    unbound.addr().to_string()
}

#[test]
fn mesh_names_get_every_answer_type_and_are_never_forwarded() {
    let unbound = upstream();
    let records = Records::new();
    records.write(3, SystemTime::now(), &mesh_records());
    let dns = MeshDns::start(free_port(), &records.path, &["--upstream", &upstream_arg(&unbound)]);
    let server = dns.addr();

    let a = dig(server, "cart.shop.aether.internal", "A", &[]);
    assert_eq!(a.status, "NOERROR", "{}", a.raw);
    assert!(a.flags.contains(&"aa".to_owned()), "authoritative: {}", a.raw);
    assert_eq!(a.answer_data("A"), vec!["240.240.0.9"], "{}", a.raw);
    assert_eq!(a.answers[0].1, 30, "TTL 30: {}", a.raw);

    let aaaa = dig(server, "CART.shop.Aether.Internal", "AAAA", &[]);
    assert_eq!(aaaa.answer_data("AAAA"), vec!["fd00::9"], "{}", aaaa.raw);

    // No IPv6 VIP, or another type: NODATA with the SOA.
    for (name, rtype) in [
        ("web.default.aether.internal", "AAAA"),
        ("cart.shop.aether.internal", "MX"),
        ("cart.shop.aether.internal", "TXT"),
    ] {
        let nodata = dig(server, name, rtype, &[]);
        assert_eq!(nodata.status, "NOERROR", "{}", nodata.raw);
        assert!(nodata.answers.is_empty(), "{}", nodata.raw);
        assert_eq!(nodata.authority.len(), 1, "SOA in authority: {}", nodata.raw);
        assert_eq!(nodata.authority[0].2, "SOA");
        assert!(
            nodata.authority[0].3.contains(" 3 "),
            "serial = generation 3: {}",
            nodata.raw
        );
    }

    // Unknown mesh names: NXDOMAIN here, even though the upstream has a record for one.
    for name in [
        "nope.shop.aether.internal",
        "x.cart.shop.aether.internal",
        "nons.aether.internal",
    ] {
        let nx = dig(server, name, "A", &[]);
        assert_eq!(nx.status, "NXDOMAIN", "{name}: {}", nx.raw);
    }
    // Kubernetes search-path expansions of mesh names: NXDOMAIN locally (unbound would say otherwise).
    for name in [
        "cart.shop.aether.internal.shop.svc.cluster.local",
        "cart.shop.aether.internal.svc.cluster.local",
        "cart.shop.aether.internal.cluster.local",
    ] {
        let nx = dig(server, name, "A", &[]);
        assert_eq!(nx.status, "NXDOMAIN", "{name}: {}", nx.raw);
    }
    let apex = dig(server, "aether.internal", "SOA", &[]);
    assert_eq!(apex.answer_data("SOA").len(), 1, "{}", apex.raw);
    let ns = dig(server, "shop.aether.internal", "A", &[]);
    assert_eq!((ns.status.as_str(), ns.answers.len()), ("NOERROR", 0), "{}", ns.raw);

    // The same over TCP.
    let tcp = dig(server, "web.default.aether.internal", "A", &["+tcp"]);
    assert_eq!(tcp.answer_data("A"), vec!["240.240.0.7"], "{}", tcp.raw);

    assert_eq!(
        dns.queries("forwarded", "udp") + dns.queries("forwarded", "tcp"),
        0.0,
        "a mesh name was forwarded"
    );
    assert_eq!(dns.queries("search_nxdomain", "udp"), 3.0);
    assert_eq!(dns.queries("answer", "tcp"), 1.0);
    assert_eq!(dns.metric("aether_mesh_dns_generation"), 3.0);
    assert_eq!(dns.metric("aether_mesh_dns_records"), 2.0);
}

#[test]
fn other_names_are_forwarded_over_udp_and_tcp_with_edns_preserved() {
    let unbound = upstream();
    let records = Records::new();
    records.write(1, SystemTime::now(), &mesh_records());
    let dns = MeshDns::start(free_port(), &records.path, &["--upstream", &upstream_arg(&unbound)]);
    let server = dns.addr();

    let udp = dig(server, "www.fwd.test", "A", &[]);
    assert_eq!(udp.answer_data("A"), vec!["192.0.2.1"], "{}", udp.raw);
    assert_eq!(udp.edns_udp, Some(1400), "the upstream's OPT comes back: {}", udp.raw);
    assert!(udp.flags.contains(&"ra".to_owned()), "{}", udp.raw);

    let noedns = dig(server, "www.fwd.test", "A", &["+noedns"]);
    assert_eq!(noedns.answer_data("A"), vec!["192.0.2.1"]);
    assert_eq!(noedns.edns_udp, None, "no EDNS asked, none answered: {}", noedns.raw);

    let tcp = dig(server, "www.fwd.test", "A", &["+tcp"]);
    assert_eq!(tcp.answer_data("A"), vec!["192.0.2.1"], "{}", tcp.raw);
    let missing = dig(server, "missing.fwd.test", "A", &["+tcp"]);
    assert_eq!(
        missing.status, "NXDOMAIN",
        "the upstream's answer, relayed: {}",
        missing.raw
    );

    assert_eq!(dns.queries("forwarded", "udp"), 2.0);
    assert_eq!(dns.queries("forwarded", "tcp"), 2.0);
}

#[test]
fn truncated_upstream_answers_are_retried_over_tcp() {
    let unbound = upstream();
    let records = Records::new();
    records.write(1, SystemTime::now(), &mesh_records());
    let dns = MeshDns::start(free_port(), &records.path, &["--upstream", &upstream_arg(&unbound)]);
    let server = dns.addr();

    // unbound truncates at 512 bytes over UDP; the client takes 4096: mesh-dns asks again
    // over TCP and the whole answer fits the client's UDP.
    let full = dig(server, "big.test", "TXT", &["+notcp", "+ignore", "+bufsize=4096"]);
    assert!(!full.flags.contains(&"tc".to_owned()), "{}", full.raw);
    assert_eq!(full.answer_data("TXT").len(), 30, "{}", full.raw);
    assert_eq!(dns.metric("aether_mesh_dns_tcp_retries_total"), 1.0);

    // A client that takes less than the answer gets TC, and dig then retries over TCP itself.
    let cut = dig(server, "big.test", "TXT", &["+notcp", "+ignore", "+bufsize=1232"]);
    assert!(cut.flags.contains(&"tc".to_owned()), "{}", cut.raw);
    assert!(cut.answers.is_empty());
    let retried = dig(server, "big.test", "TXT", &["+bufsize=1232"]);
    assert_eq!(retried.answer_data("TXT").len(), 30, "{}", retried.raw);
    assert!(dns.queries("forwarded", "tcp") >= 1.0);
}

#[test]
fn a_dead_or_silent_upstream_fails_over_and_all_dead_is_servfail() {
    let unbound = upstream();
    let records = Records::new();
    records.write(1, SystemTime::now(), &mesh_records());
    // Bound but never answering: only a timeout tells.
    let silent = UdpSocket::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let dns = MeshDns::start(
        free_port(),
        &records.path,
        &[
            "--upstream",
            &silent_addr,
            "--upstream",
            &upstream_arg(&unbound),
            "--upstream-timeout",
            "300ms",
        ],
    );
    let answer = dig(dns.addr(), "www.fwd.test", "A", &[]);
    assert_eq!(answer.answer_data("A"), vec!["192.0.2.1"], "{}", answer.raw);
    let timeouts = format!("aether_mesh_dns_upstream_errors_total{{upstream=\"{silent_addr}\",reason=\"timeout\"}}");
    assert_eq!(dns.metric(&timeouts), 1.0);
    // The failed upstream is no longer tried first.
    let again = dig(dns.addr(), "www.fwd.test", "A", &[]);
    assert_eq!(again.answer_data("A"), vec!["192.0.2.1"]);
    assert_eq!(dns.metric(&timeouts), 1.0);
    drop(dns);

    let dead = free_port();
    let dns = MeshDns::start(
        free_port(),
        &records.path,
        &[
            "--upstream",
            &silent_addr,
            "--upstream",
            &format!("127.0.0.1:{dead}"),
            "--upstream-timeout",
            "300ms",
        ],
    );
    let failed = dig(dns.addr(), "www.fwd.test", "A", &[]);
    assert_eq!(failed.status, "SERVFAIL", "{}", failed.raw);
    assert_eq!(dns.queries("servfail_upstream", "udp"), 1.0);
    // Mesh names do not depend on upstreams.
    let mesh = dig(dns.addr(), "cart.shop.aether.internal", "A", &[]);
    assert_eq!(mesh.answer_data("A"), vec!["240.240.0.9"]);
}

#[test]
fn servfail_until_a_record_file_loads_then_changes_are_picked_up() {
    let unbound = upstream();
    let records = Records::new();
    // The directory does not exist yet: the watch cannot start, polling covers it.
    let mut dns = MeshDns::start(
        free_port(),
        &records.path,
        &["--upstream", &upstream_arg(&unbound), "--poll-interval", "200ms"],
    );
    let server = dns.addr();
    let before = dig(server, "cart.shop.aether.internal", "A", &[]);
    assert_eq!(before.status, "SERVFAIL", "{}", before.raw);
    assert_eq!(
        dig(server, "www.fwd.test", "A", &[]).answer_data("A"),
        vec!["192.0.2.1"]
    );
    assert_eq!(dns.metric("aether_mesh_dns_watch_up"), 0.0);

    records.write(1, SystemTime::now(), &mesh_records());
    dns.wait_for("the first record file", |d| {
        d.metric("aether_mesh_dns_generation") == 1.0
    });
    assert_eq!(
        dig(server, "cart.shop.aether.internal", "A", &[]).answer_data("A"),
        vec!["240.240.0.9"]
    );
    dns.wait_for("the directory watch", |d| d.metric("aether_mesh_dns_watch_up") == 1.0);

    // A change arrives through the watch.
    records.write(2, SystemTime::now(), &[("shop", "cart", v4([240, 240, 1, 1]))]);
    dns.wait_for("generation 2", |d| d.metric("aether_mesh_dns_generation") == 2.0);
    assert_eq!(
        dig(server, "cart.shop.aether.internal", "A", &[]).answer_data("A"),
        vec!["240.240.1.1"]
    );
    assert_eq!(dig(server, "web.default.aether.internal", "A", &[]).status, "NXDOMAIN");
    assert_eq!(dns.queries("servfail_not_loaded", "udp"), 1.0);
}

#[test]
fn malformed_and_stale_files_and_packets_keep_the_last_good_table() {
    let unbound = upstream();
    let records = Records::new();
    records.write(5, SystemTime::now(), &mesh_records());
    let mut dns = MeshDns::start(
        free_port(),
        &records.path,
        &[
            "--upstream",
            &upstream_arg(&unbound),
            "--stale-after",
            "30s",
            "--poll-interval",
            "200ms",
        ],
    );
    let server = dns.addr();
    assert_eq!(dns.metric("aether_mesh_dns_snapshot_stale"), 0.0);
    malformed_files_are_counted_and_the_last_table_serves(&mut dns, &records);

    // The file disappears: the last table keeps serving.
    std::fs::remove_file(&records.path).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(cart_a(server), vec!["240.240.0.9"]);

    // A file its writer stopped re-stamping an hour ago: stale, reported, still served.
    records.write(
        7,
        SystemTime::now() - Duration::from_secs(3600),
        &[("shop", "cart", v4([240, 240, 7, 7]))],
    );
    dns.wait_for("generation 7", |d| d.metric("aether_mesh_dns_generation") == 7.0);
    dns.wait_for("the stale flag", |d| d.metric("aether_mesh_dns_snapshot_stale") == 1.0);
    assert!(dns.metric("aether_mesh_dns_snapshot_age_seconds") >= 3600.0);
    assert_eq!(cart_a(server), vec!["240.240.7.7"]);
    // Re-stamped: fresh again.
    records.write(7, SystemTime::now(), &[("shop", "cart", v4([240, 240, 7, 7]))]);
    dns.wait_for("fresh again", |d| d.metric("aether_mesh_dns_snapshot_stale") == 0.0);

    malformed_packets_get_a_formerr_or_nothing(server);
    assert_eq!(cart_a(server), vec!["240.240.7.7"]);
    assert!(dns.metric("aether_mesh_dns_malformed_packets_total") >= 4.0);
    dns.proc.assert_running();
}

/// The A answer for cart.shop.
fn cart_a(server: SocketAddr) -> Vec<String> {
    dig(server, "cart.shop.aether.internal", "A", &[]).answer_data("A")
}

/// Each malformed record file is counted and logged, and generation 5's answers stay.
fn malformed_files_are_counted_and_the_last_table_serves(dns: &mut MeshDns, records: &Records) {
    let bad: [&[u8]; 4] = [
        b"{ not json",
        br#"{"version":2,"generation":6,"written_at_unix_ms":1,"records":{}}"#,
        br#"{"version":1,"generation":6,"written_at_unix_ms":1,"records":{"shop/cart":{"v4":"999.1.1.1"}}}"#,
        b"",
    ];
    for (i, bytes) in bad.iter().enumerate() {
        // File errors are logged at most once a second.
        std::thread::sleep(Duration::from_millis(1100));
        records.write_raw(bytes);
        let want = (i + 1) as f64;
        dns.wait_for("the malformed file to be counted", |d| {
            d.metric("aether_mesh_dns_malformed_files_total") == want
        });
        let still = dig(dns.addr(), "cart.shop.aether.internal", "A", &[]);
        assert_eq!(still.answer_data("A"), vec!["240.240.0.9"], "file {i}: {}", still.raw);
    }
    assert_eq!(dns.metric("aether_mesh_dns_generation"), 5.0);
    assert!(
        dns.proc.logs().contains("version: 2 is not supported"),
        "{}",
        dns.proc.logs()
    );
    assert!(
        dns.proc.logs().contains("records[\\\"shop/cart\\\"].v4")
            || dns.proc.logs().contains("records[\"shop/cart\"].v4")
    );
}

/// Malformed packets: a FORMERR when there is a header to answer, nothing otherwise; never a crash.
fn malformed_packets_get_a_formerr_or_nothing(server: SocketAddr) {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut garbage = build_query(0xbeef, "cart.shop.aether.internal", A, IN);
    garbage.truncate(20);
    socket.send_to(&garbage, server).unwrap();
    let mut buf = [0u8; 512];
    let (n, _) = socket.recv_from(&mut buf).expect("a FORMERR answer");
    assert!(
        n >= 12 && buf[..2] == [0xbe, 0xef] && buf[3] & 0x0f == 1,
        "FORMERR: {:?}",
        &buf[..n]
    );
    for packet in [&[0u8; 3][..], &[0xffu8; 300][..], &[][..]] {
        socket.send_to(packet, server).unwrap();
    }
    let mut tcp = std::net::TcpStream::connect(server).unwrap();
    std::io::Write::write_all(&mut tcp, &[0, 5, 1, 2, 3, 4, 5]).unwrap();
    drop(tcp);
}

#[test]
fn reloads_under_query_load_never_fail_a_query() {
    let unbound = upstream();
    let records = Records::new();
    let gen_ip = |g: u64| [240, 240, (g >> 8) as u8, (g & 0xff) as u8];
    records.write(1, SystemTime::now(), &[("shop", "cart", v4(gen_ip(1)))]);
    let mut dns = MeshDns::start(free_port(), &records.path, &["--upstream", &upstream_arg(&unbound)]);
    let server: SocketAddr = dns.addr();

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            let answered = answered.clone();
            std::thread::spawn(move || {
                let mut last_generation = 0u64;
                let mut failures = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    match query_udp(server, "cart.shop.aether.internal", A, IN, Duration::from_secs(2)) {
                        None => failures.push("timeout".to_owned()),
                        Some(answer) => {
                            let rcode = answer[3] & 0x0f;
                            let ancount = u16::from_be_bytes([answer[6], answer[7]]);
                            if rcode != 0 || ancount != 1 || answer.len() < 4 {
                                failures.push(format!("rcode {rcode}, {ancount} answers"));
                                continue;
                            }
                            let ip = &answer[answer.len() - 4..];
                            let generation = (u64::from(ip[2]) << 8) | u64::from(ip[3]);
                            if ip[..2] != [240, 240] || generation < last_generation {
                                failures.push(format!("went from generation {last_generation} to {ip:?}"));
                            }
                            last_generation = generation;
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                failures
            })
        })
        .collect();
    for generation in 2..=60u64 {
        records.write(
            generation,
            SystemTime::now(),
            &[("shop", "cart", v4(gen_ip(generation)))],
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    dns.wait_for("the last generation", |d| {
        d.metric("aether_mesh_dns_generation") == 60.0
    });
    stop.store(true, Ordering::Relaxed);
    let failures: Vec<String> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    assert!(failures.is_empty(), "failed queries during reloads: {failures:?}");
    assert!(
        answered.load(Ordering::Relaxed) > 100,
        "too little load: {}",
        answered.load(Ordering::Relaxed)
    );
    assert!(dns.metric("aether_mesh_dns_reloads_total{result=\"ok\"}") >= 10.0);
    assert_eq!(dns.metric("aether_mesh_dns_reloads_total{result=\"error\"}"), 0.0);
}

/// A surge rollout on the host network: the successor shares the DNS port and the admin address with its
/// predecessor. It serves DNS and is ready (its own ready file) at once; its admin endpoints follow once the
/// predecessor is gone.
#[test]
fn a_surge_successor_serves_at_once_and_takes_the_admin_address_when_the_predecessor_goes() {
    let unbound = upstream();
    let records = Records::new();
    records.write(1, SystemTime::now(), &mesh_records());
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let (old_ready, new_ready) = (dir.path().join("old-ready"), dir.path().join("new-ready"));
    let upstream = upstream_arg(&unbound);
    let ready_arg = |p: &std::path::Path| p.display().to_string();
    let mut old = MeshDns::start(
        port,
        &records.path,
        &["--upstream", &upstream, "--ready-file", &ready_arg(&old_ready)],
    );
    assert!(old_ready.exists(), "a ready mesh-dns has its ready file");
    let mut new = MeshDns::spawn(
        port,
        old.admin,
        &records.path,
        &["--upstream", &upstream, "--ready-file", &ready_arg(&new_ready)],
    );
    new.wait_for("the successor's ready file", |_| new_ready.exists());
    new.wait_for("the successor finding the admin address busy", |d| {
        d.proc.logs().contains("admin address busy")
    });
    // Both answer on the shared port; the admin address is still the predecessor's.
    let before = old.queries("answer", "udp");
    for _ in 0..40 {
        let answer =
            query_udp(new.addr(), "cart.shop.aether.internal", A, IN, Duration::from_secs(2)).expect("an answer");
        assert_eq!(answer[3] & 0x0f, 0);
    }
    let by_old = old.queries("answer", "udp") - before;
    assert!(
        by_old < 40.0,
        "the successor answers part of the queries (the predecessor answered {by_old} of 40)"
    );
    // The predecessor goes: the successor takes the admin address and has counted what it answered.
    old.proc.kill();
    new.wait_for("the successor's admin", |d| http_get(d.admin, "/healthz").is_some());
    assert_eq!(new.queries("answer", "udp"), 40.0 - by_old);
    let (code, _) = http_get(new.admin, "/ready").expect("/ready");
    assert_eq!(code, 200);
    assert!(new_ready.exists());
}

#[test]
fn two_instances_share_one_port_and_either_can_go() {
    let unbound = upstream();
    let records = Records::new();
    records.write(1, SystemTime::now(), &mesh_records());
    let port = free_port();
    let mut old = MeshDns::start(port, &records.path, &["--upstream", &upstream_arg(&unbound)]);
    let new = MeshDns::start(port, &records.path, &["--upstream", &upstream_arg(&unbound)]);
    let server = new.addr();
    for _ in 0..40 {
        let answer = query_udp(server, "cart.shop.aether.internal", A, IN, Duration::from_secs(2)).expect("an answer");
        assert_eq!(answer[3] & 0x0f, 0);
    }
    let served = |d: &MeshDns| d.queries("answer", "udp");
    assert!(
        served(&old) > 0.0 && served(&new) > 0.0,
        "both instances answer on the shared port: {} and {}",
        served(&old),
        served(&new)
    );
    assert_eq!(served(&old) + served(&new), 40.0);
    // The old one leaves: every query is still answered, over UDP and TCP.
    old.proc.kill();
    for _ in 0..40 {
        let answer = query_udp(server, "cart.shop.aether.internal", A, IN, Duration::from_secs(2)).expect("an answer");
        assert_eq!(answer[3] & 0x0f, 0);
    }
    let tcp = dig(server, "cart.shop.aether.internal", "A", &["+tcp"]);
    assert_eq!(tcp.answer_data("A"), vec!["240.240.0.9"]);
}
