//! The JVM decides whether Spark retries a failed fetch from the error kind alone
//! (`RdmaShuffleException.isTransientKind`). These tests keep the two sides' lists of kinds
//! equal: every kind the native code can send is known to Java, with the same verdict.

use rdma_shuffle_jni::errors::BRIDGE_KINDS;
use rdma_shuffle_shuffle::FailureCode;
use std::collections::BTreeSet;
use std::path::Path;

const JAVA: &str = "../../jvm-plugin/plugin/src/main/java/org/apache/spark/shuffle/rdma/RdmaShuffleException.java";

/// The string literals of `NAME = kinds(...);` in the Java source.
fn java_set(src: &str, name: &str) -> BTreeSet<String> {
    let start = src.find(&format!("{name} = kinds(")).unwrap_or_else(|| panic!("{name} not declared in {JAVA}"));
    let decl = &src[start..];
    let decl = &decl[..decl.find(");").expect("declaration ends")];
    decl.split('"').skip(1).step_by(2).map(str::to_owned).collect()
}

fn native_kinds(transient: bool) -> BTreeSet<String> {
    let codes = FailureCode::ALL.iter().filter(|c| c.is_transient() == transient).map(|c| c.name().to_owned());
    let bridge = BRIDGE_KINDS.iter().filter(|(_, t)| *t == transient).map(|(k, _)| (*k).to_owned());
    codes.chain(bridge).collect()
}

#[test]
fn java_classifies_every_native_kind_the_same_way() {
    let src = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(JAVA)).expect("read the Java source");
    assert_eq!(java_set(&src, "TRANSIENT_KINDS"), native_kinds(true), "transient kinds differ between Rust and Java");
    assert_eq!(java_set(&src, "PERMANENT_KINDS"), native_kinds(false), "permanent kinds differ between Rust and Java");
}

#[test]
fn every_kind_the_bridge_raises_is_listed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let listed: BTreeSet<&str> = BRIDGE_KINDS.iter().map(|(k, _)| *k).collect();
    let mut used = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let src = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for part in src.split("BridgeError::new(\"").skip(1) {
            used.insert(part[..part.find('"').unwrap()].to_owned());
        }
    }
    assert!(!used.is_empty(), "found no BridgeError::new calls under {}", dir.display());
    for k in &used {
        assert!(listed.contains(k.as_str()), "kind {k:?} is raised but missing from BRIDGE_KINDS");
    }
}

#[test]
fn failure_code_names_are_distinct_and_round_trip() {
    let names: BTreeSet<&str> = FailureCode::ALL.iter().map(|c| c.name()).collect();
    assert_eq!(names.len(), FailureCode::ALL.len());
    for c in FailureCode::ALL {
        assert_eq!(FailureCode::from_u16(c.to_u16()), c);
    }
}
