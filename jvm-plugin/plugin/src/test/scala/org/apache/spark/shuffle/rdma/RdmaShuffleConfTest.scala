/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.File
import java.nio.charset.StandardCharsets
import java.nio.file.Files

import org.junit.Assert._
import org.junit.Test

import org.apache.spark.SparkConf

class RdmaShuffleConfTest {
  private def conf(kv: (String, String)*): SparkConf = {
    val c = new SparkConf(false)
    kv.foreach { case (k, v) => c.set(k, v) }
    c
  }

  private def lines(text: String): Map[String, String] =
    text.split("\n").map { l =>
      val i = l.indexOf('='); l.substring(0, i) -> l.substring(i + 1)
    }
      .toMap

  @Test def theJarCarriesTheRepositorysSchema(): Unit = {
    // Maven copies settings/settings.tsv into the classes; a stale copy would mean the JVM and
    // the native engine (which compiles in the repository's file) read different schemas.
    val repoFile = new File("../../settings/settings.tsv")
    assertTrue(s"${repoFile.getAbsolutePath} exists", repoFile.isFile)
    val inRepo = new String(Files.readAllBytes(repoFile.toPath), StandardCharsets.UTF_8)
    val in = getClass.getResourceAsStream(SettingsSchema.ResourcePath)
    val inJar =
      try scala.io.Source.fromInputStream(in, "UTF-8").mkString
      finally in.close()
    assertEquals(inRepo, inJar)
    assertEquals(SettingsSchema.parse(inRepo), SettingsSchema.all)
  }

  @Test def everySchemaKeyResolvesToItsDefault(): Unit = {
    val s = RdmaShuffleConf(conf())
    val text = s.engineConfig("3", "app-1", None, "127.0.0.1")
    val sent = lines(text)
    for (spec <- SettingsSchema.all) {
      val expected =
        if (spec.fallback.contains(SettingsSchema.ExecutorHost)) {
          assertTrue(spec.key, s.fromExecutorHost.contains(spec.key))
          "127.0.0.1"
        } else {
          val d = spec.default.map(RdmaShuffleConf.canonical(spec, _, "the default")).getOrElse("")
          assertEquals(spec.key, d, s(spec.key))
          d
        }
      if (spec.forEngine) assertEquals(s"$spec sent to the engine", expected, sent(spec.key))
      else assertFalse(s"${spec.key} is JVM-only", sent.contains(spec.key))
    }
    // Canonical units, parsed by Spark's own parsers (the engine parses the same file itself).
    assertTrue(s.enabled)
    assertEquals("65536", s("spark.shuffle.rdma.eagerThreshold"))
    assertEquals(
      "4096,16384,65536,262144,1048576,2097152,4194304,8388608,16777216",
      s("spark.shuffle.rdma.pool.tiers"))
    assertEquals("120000", s("spark.shuffle.rdma.fetchTimeout"))
    assertEquals("", s("spark.shuffle.rdma.device"))
  }

  @Test def timeoutsFollowSparkSettings(): Unit = {
    val a = RdmaShuffleConf(conf("spark.network.timeout" -> "20s"))
    assertEquals("20000", a("spark.shuffle.rdma.connectTimeout"))
    assertEquals("20000", a("spark.shuffle.rdma.fetchTimeout"))
    assertEquals("20000", a("spark.shuffle.rdma.idleTimeout"))
    val b = RdmaShuffleConf(conf(
      "spark.network.timeout" -> "20s",
      "spark.shuffle.io.connectionTimeout" -> "10s"))
    assertEquals("10000", b("spark.shuffle.rdma.connectTimeout"))
    assertEquals("10000", b("spark.shuffle.rdma.idleTimeout"))
    assertEquals("20000", b("spark.shuffle.rdma.fetchTimeout"))
    val c = RdmaShuffleConf(conf(
      "spark.shuffle.io.connectionTimeout" -> "10s",
      "spark.shuffle.rdma.connectTimeout" -> "3s",
      "spark.shuffle.rdma.fetchTimeout" -> "1min"))
    assertEquals("3000", c("spark.shuffle.rdma.connectTimeout"))
    assertEquals("60000", c("spark.shuffle.rdma.fetchTimeout"))
  }

  private def rejects(kv: (String, String), mustMention: String*): Unit = {
    val e = assertThrows(classOf[RdmaShuffleConfigException], () => RdmaShuffleConf(conf(kv)))
    (kv._1 +: mustMention).foreach(m =>
      assertTrue(s"'${e.getMessage}' should mention '$m'", e.getMessage.contains(m)))
  }

  @Test def badValuesNameTheSetting(): Unit = {
    rejects(
      "spark.shuffle.rdma.transport" -> "infiniband",
      "infiniband",
      "must be one of",
      "auto|tcp")
    rejects("spark.shuffle.rdma.eagerThreshold" -> "lots", "lots", "not a size")
    rejects("spark.shuffle.rdma.eagerThreshold" -> "0", "1..16777216 bytes")
    rejects("spark.shuffle.rdma.eagerThreshold" -> "32m", "1..16777216 bytes")
    rejects("spark.shuffle.rdma.pool.tiers" -> "64k,4k", "ascending")
    rejects("spark.shuffle.rdma.pool.tiers" -> "4k,big", "big")
    rejects(
      "spark.shuffle.rdma.pool.capBytes" -> "1m",
      "largest pool tier",
      "spark.shuffle.rdma.pool.tiers")
    rejects("spark.shuffle.rdma.port" -> "70000", "0..65535")
    rejects("spark.shuffle.rdma.port" -> "x", "not a non-negative integer")
    rejects("spark.shuffle.rdma.enabled" -> "yes", "true or false")
    rejects("spark.shuffle.rdma.fetchTimeout" -> "soon", "duration")
    rejects("spark.shuffle.rdma.fetchTimeout" -> "0", "at least 1 ms")
    rejects("spark.shuffle.rdma.recvBuffers" -> "4", "16..65536")
    rejects("spark.shuffle.rdma.bindHost" -> "no-such-host.invalid", "resolve")
    // A bad fallback names the Spark setting it came from and the one it was used for.
    rejects("spark.network.timeout" -> "forever", "used for spark.shuffle.rdma.connectTimeout")
  }

  @Test def engineConfigLines(): Unit = {
    val s = RdmaShuffleConf(conf(
      "spark.shuffle.rdma.transport" -> "TCP",
      "spark.shuffle.rdma.eagerThreshold" -> "8k",
      "spark.shuffle.rdma.gidIndex" -> "1",
      "spark.shuffle.rdma.verbs.gidIndex" -> "2"
    ))
    val text = s.engineConfig("3", "app-1", Some("s3cret"), "localhost")
    val sent = lines(text)
    assertTrue(text.endsWith("\n"))
    assertEquals("tcp", sent("spark.shuffle.rdma.transport"))
    assertEquals("8192", sent("spark.shuffle.rdma.eagerThreshold"))
    assertEquals("1", sent("spark.shuffle.rdma.gidIndex"))
    assertEquals(
      "the executor's host, as an address",
      RdmaShuffleConf.hostAddress("localhost").get,
      sent("spark.shuffle.rdma.bindHost"))
    assertFalse(
      "unknown keys are not forwarded",
      sent.contains("spark.shuffle.rdma.verbs.gidIndex"))
    assertEquals("3", sent("spark.executor.id"))
    assertEquals("app-1", sent("spark.app.id"))
    assertEquals("true", sent("spark.authenticate"))
    assertEquals("s3cret", sent("spark.authenticate.secret"))
    assertEquals("one line per key", text.split("\n").length, sent.size)
    assertFalse(s.engineConfig("3", "app-1", None, "localhost").contains("authenticate"))
    assertEquals(None, s.explicitBindHost)
    val bound = RdmaShuffleConf(conf("spark.shuffle.rdma.bindHost" -> "127.0.0.2"))
    assertEquals(Some("127.0.0.2"), bound.explicitBindHost)
    assertEquals(
      "127.0.0.2",
      lines(bound.engineConfig("3", "a", None, "localhost"))("spark.shuffle.rdma.bindHost"))
  }

  @Test def unknownKeysAreNamedWithTheNearestValidKey(): Unit = {
    val s = RdmaShuffleConf(conf(
      "spark.shuffle.rdma.eagerTreshold" -> "8k",
      "spark.shuffle.rdma.pool.capbytes" -> "1g",
      "spark.shuffle.rdma.verbs.gidIndex" -> "1",
      "spark.shuffle.rdma.port" -> "0"
    ))
    assertEquals(
      Seq(
        "spark.shuffle.rdma.eagerTreshold",
        "spark.shuffle.rdma.pool.capbytes",
        "spark.shuffle.rdma.verbs.gidIndex"),
      s.unknownKeys)
    val w = s.unknownKeyWarnings
    assertEquals(3, w.size)
    assertTrue(w(0), w(0).contains("did you mean spark.shuffle.rdma.eagerThreshold?"))
    assertTrue(w(1), w(1).contains("did you mean spark.shuffle.rdma.pool.capBytes?"))
    assertTrue(w(2), w(2).contains("did you mean spark.shuffle.rdma.gidIndex?"))
    assertEquals("the misspelt value is not used", "65536", s("spark.shuffle.rdma.eagerThreshold"))
    assertEquals(Nil, RdmaShuffleConf(conf("spark.shuffle.rdma.port" -> "1")).unknownKeys)
    assertEquals(3, SettingsSchema.editDistance("kitten", "sitting"))
  }

  @Test def lineBreaksCannotBeSmuggledIn(): Unit = {
    val s = RdmaShuffleConf(conf())
    val e = assertThrows(
      classOf[RdmaShuffleConfigException],
      () =>
        s.engineConfig("1", "app", Some("abc\nspark.shuffle.rdma.port=1"), "127.0.0.1"))
    assertTrue(e.getMessage.contains("<secret>"))
    assertFalse("the secret is never echoed", e.getMessage.contains("abc"))
  }
}
