/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.junit.Assert._
import org.junit.Test

import org.apache.spark.SparkConf

class RdmaShuffleConfTest {
  private def conf(kv: (String, String)*): SparkConf = {
    val c = new SparkConf(false)
    kv.foreach { case (k, v) => c.set(k, v) }
    c
  }

  @Test def defaults(): Unit = {
    val s = RdmaShuffleConf(conf())
    assertTrue(s.enabled)
    assertEquals("auto", s.transport)
    assertEquals(64L * 1024, s.eagerThresholdBytes)
    assertEquals(Seq(4L << 10, 16L << 10, 64L << 10, 256L << 10, 1L << 20, 2L << 20, 4L << 20,
      8L << 20, 16L << 20), s.poolTierBytes)
    assertEquals(512L << 20, s.poolCapBytes)
    assertEquals(0, s.port)
    assertEquals(120000L, s.connectTimeoutMs)
    assertEquals(120000L, s.fetchTimeoutMs)
  }

  @Test def timeoutsFollowSparkSettings(): Unit = {
    val a = RdmaShuffleConf(conf("spark.network.timeout" -> "20s"))
    assertEquals(20000L, a.connectTimeoutMs)
    assertEquals(20000L, a.fetchTimeoutMs)
    val b = RdmaShuffleConf(conf("spark.network.timeout" -> "20s",
      "spark.shuffle.io.connectionTimeout" -> "10s"))
    assertEquals(10000L, b.connectTimeoutMs)
    assertEquals(20000L, b.fetchTimeoutMs)
    val c = RdmaShuffleConf(conf("spark.shuffle.io.connectionTimeout" -> "10s",
      "spark.shuffle.rdma.connectTimeout" -> "3s", "spark.shuffle.rdma.fetchTimeout" -> "1min"))
    assertEquals(3000L, c.connectTimeoutMs)
    assertEquals(60000L, c.fetchTimeoutMs)
  }

  private def rejects(kv: (String, String), mustMention: String*): Unit = {
    val e = assertThrows(classOf[RdmaShuffleConfigException], () => RdmaShuffleConf(conf(kv)))
    (kv._1 +: mustMention).foreach(m =>
      assertTrue(s"'${e.getMessage}' should mention '$m'", e.getMessage.contains(m)))
  }

  @Test def badValuesNameTheSetting(): Unit = {
    rejects("spark.shuffle.rdma.transport" -> "infiniband", "auto|tcp|verbs")
    rejects("spark.shuffle.rdma.eagerThreshold" -> "lots", "lots")
    rejects("spark.shuffle.rdma.eagerThreshold" -> "0", "positive")
    rejects("spark.shuffle.rdma.pool.tiers" -> "64k,4k", "ascending")
    rejects("spark.shuffle.rdma.pool.tiers" -> "4k,big", "big")
    rejects("spark.shuffle.rdma.pool.capBytes" -> "1m", "largest pool tier",
      "spark.shuffle.rdma.pool.tiers")
    rejects("spark.shuffle.rdma.port" -> "70000", "0..65535")
    rejects("spark.shuffle.rdma.port" -> "x", "not a port")
    rejects("spark.shuffle.rdma.enabled" -> "yes", "true or false")
    rejects("spark.shuffle.rdma.fetchTimeout" -> "soon", "duration")
  }

  @Test def engineConfigLines(): Unit = {
    val s = RdmaShuffleConf(conf("spark.shuffle.rdma.transport" -> "TCP",
      "spark.shuffle.rdma.eagerThreshold" -> "8k", "spark.shuffle.rdma.verbs.gidIndex" -> "1"))
    val text = s.engineConfig("3", "app-1", Some("s3cret"))
    val lines = text.split("\n").toSeq
    assertTrue(text.endsWith("\n"))
    assertTrue(lines.contains("spark.shuffle.rdma.transport=tcp"))
    assertTrue(lines.contains("spark.shuffle.rdma.eagerThreshold=8192"))
    assertTrue(lines.contains("spark.shuffle.rdma.pool.tiers=" +
      "4096,16384,65536,262144,1048576,2097152,4194304,8388608,16777216"))
    assertTrue("native-only keys pass through", lines.contains("spark.shuffle.rdma.verbs.gidIndex=1"))
    assertTrue(lines.contains("spark.executor.id=3"))
    assertTrue(lines.contains("spark.app.id=app-1"))
    assertTrue(lines.contains("spark.authenticate=true"))
    assertTrue(lines.contains("spark.authenticate.secret=s3cret"))
    assertEquals("typed keys are not duplicated by the pass-through", 1,
      lines.count(_.startsWith("spark.shuffle.rdma.transport=")))
    assertFalse(s.engineConfig("3", "app-1", None).contains("authenticate"))
  }

  @Test def lineBreaksCannotBeSmuggledIn(): Unit = {
    val s = RdmaShuffleConf(conf())
    val e = assertThrows(classOf[RdmaShuffleConfigException], () =>
      s.engineConfig("1", "app", Some("abc\nspark.shuffle.rdma.port=1")))
    assertTrue(e.getMessage.contains("<secret>"))
    assertFalse("the secret is never echoed", e.getMessage.contains("abc"))
  }
}
