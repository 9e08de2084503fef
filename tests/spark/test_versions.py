"""The Spark version the plugin compiles against must be the pyspark runtime the suite runs."""
import re
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NS = {"m": "http://maven.apache.org/POM/4.0.0"}


def _pom_versions():
    root = ET.parse(REPO / "jvm-plugin" / "pom.xml").getroot()
    default = root.find("m:properties/m:spark.version", NS).text
    profiles = {p.find("m:id", NS).text: p.find("m:properties/m:spark.version", NS).text
                for p in root.findall("m:profiles/m:profile", NS)}
    return default, profiles


def test_spark_env_pins_match_the_pom():
    text = (REPO / "scripts" / "spark-env.sh").read_text()
    default, profiles = _pom_versions()
    assert re.search(rf"^_rdma_default_spark={re.escape(default)}$", text, re.M), default
    assert re.search(rf"^_rdma_35_spark={re.escape(profiles['spark-3.5'])}$", text, re.M), profiles
