//! Tests of the report half (no device needed).

use super::*;

fn res(bytes: usize, send: f64, read: f64) -> SizeResult {
    let p = |mbps| PathResult { mbps, p50_us: 100.0, samples: 30, rounds: 2 };
    SizeResult { bytes, blocks: 4, credits: 8, send: p(send), read: p(read) }
}

#[test]
fn sizes_parse_with_units_and_reject_junk() {
    assert_eq!(parse_size("4096").unwrap(), 4096);
    assert_eq!(parse_size("4k").unwrap(), 4096);
    assert_eq!(parse_size("16KiB").unwrap(), 16 << 10);
    assert_eq!(parse_size("1m").unwrap(), 1 << 20);
    assert_eq!(parse_size("16MB").unwrap(), 16 << 20);
    for bad in ["", "0", "k", "4x", "-4k", "99999999999999999999g"] {
        assert!(matches!(parse_size(bad), Err(SweepError::Usage(_))), "{bad} parsed");
    }
}

#[test]
fn arguments_are_checked() {
    let a = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
    let c = SweepConfig::from_args(&a("--sizes 4k,1m --device rxe0 --gid-index 1 --lat-samples 10:50 --secs 0.5")).unwrap();
    assert_eq!(c.sizes, vec![4096, 1 << 20]);
    assert_eq!((c.device.as_deref(), c.gid_index, c.lat_min, c.lat_max, c.min_secs), (Some("rxe0"), Some(1), 10, 50, 0.5));
    // Empty device / gid (unset variables in the guest) mean "pick one".
    let c = SweepConfig::from_args(&["--device".into(), "".into(), "--gid-index".into(), "".into()]).unwrap();
    assert_eq!((c.device, c.gid_index), (None, None));
    for bad in
        ["--sizes 16k,4k", "--sizes 1k", "--sizes 64m", "--secs 0", "--lat-samples 5:2", "--gid-index 300", "--bogus 1", "--out"]
    {
        let e = SweepConfig::from_args(&a(bad)).unwrap_err();
        assert!(matches!(e, SweepError::Usage(_)), "{bad}: {e}");
    }
}

#[test]
fn block_counts_buffers_and_credits_stay_bounded() {
    let c = SweepConfig::default();
    assert_eq!(c.blocks_for(4096), 256);
    assert_eq!(c.blocks_for(MIB), 64);
    assert_eq!(c.blocks_for(16 * MIB), 4);
    assert_eq!(c.blocks_for(128 * MIB), 1);
    for &s in &DEFAULT_SIZES {
        // One connection's buffers: receive + send on both sides of the pair.
        let per_side = 2 * send_path_depth(s) as u64 * max_message_for(s) as u64;
        assert!(per_side <= 160 * MIB as u64, "{s}: {per_side} bytes of buffers per side");
        assert!((4..=64).contains(&credits_for(s)));
        assert!(max_message_for(s) as usize > s);
    }
    assert_eq!(credits_for(4096), 64);
    assert_eq!(credits_for(16 * MIB), 4);
}

#[test]
fn crossover_is_the_first_size_where_read_is_faster() {
    assert_eq!(crossover(&[res(4096, 50.0, 10.0), res(65536, 80.0, 81.0), res(1 << 20, 90.0, 200.0)]), Some(65536));
    assert_eq!(crossover(&[res(4096, 50.0, 10.0), res(65536, 80.0, 80.0)]), None, "a tie is not a win");
    assert_eq!(crossover(&[]), None);
}

#[test]
fn median_of_odd_even_and_empty() {
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    assert_eq!(median(&mut []), 0.0);
}

#[test]
fn report_has_every_field_the_host_script_reads() {
    let info = RunInfo { device: "rxe0".into(), kernel: "6.1.0-x".into(), seconds: 12.3 };
    let rs = [res(4096, 50.0, 10.0), res(1 << 20, 90.0, 200.0)];
    let cfg = SweepConfig::default();
    let j = render_json(&rs, &info, &cfg);
    for key in [
        "\"device\": \"rxe0\"",
        "\"crossover_bytes\": 1048576",
        "\"note\"",
        "\"bytes\": 4096",
        "\"send_mbps\": 50.0",
        "\"read_mbps\": 200.0",
        "\"send_p50_us\": 100.0",
        "\"read_p50_us\"",
    ] {
        assert!(j.contains(key), "missing {key} in {j}");
    }
    assert!(render_json(&rs[..1], &info, &cfg).contains("\"crossover_bytes\": null"));
    assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    let t = render_table(&rs, &info);
    assert!(t.contains("4 KiB") && t.contains("1 MiB") && t.contains("READ beats SEND from 1 MiB"), "{t}");
}
