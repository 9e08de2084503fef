/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.junit.Assert._
import org.junit.Test

import org.apache.spark.SparkConf

/**
 * The hand-over decision: encryption requested means Spark's sort shuffle, never plaintext; so
 * do the settings by which Spark serves or moves shuffle files by means the engine cannot
 * follow (README "When it steps aside").
 */
class FallbackPolicyTest {
  private def policy(kv: (String, String)*): DefaultFallbackPolicy = {
    val c = new SparkConf(false)
    kv.foreach { case (k, v) => c.set(k, v) }
    new DefaultFallbackPolicy(c, RdmaShuffleConf(c), None)
  }

  private def handsOverNaming(setting: String, kv: (String, String)*): Unit = {
    val p = policy(kv: _*)
    val reason = p.reasonToHandOverAll
    assertTrue(s"$kv: $reason", reason.exists(_.contains(setting)))
    assertEquals("every shuffle", reason, p.reasonToHandOver(null))
    assertEquals(Some(setting), p.encryption)
  }

  @Test def encryptionRequestsHandEveryShuffleToSpark(): Unit = {
    handsOverNaming(
      "spark.network.crypto.enabled=true",
      "spark.authenticate" -> "true",
      "spark.network.crypto.enabled" -> "true")
    handsOverNaming("spark.network.crypto.enabled=true", "spark.network.crypto.enabled" -> "TRUE")
    handsOverNaming(
      "spark.authenticate.enableSaslEncryption=true",
      "spark.authenticate" -> "true",
      "spark.authenticate.enableSaslEncryption" -> "true")
    handsOverNaming("spark.ssl.enabled=true", "spark.ssl.enabled" -> "true")
    handsOverNaming("spark.ssl.rpc.enabled=true", "spark.ssl.rpc.enabled" -> "true")
  }

  @Test def settingsThatDoNotEncryptTheWireKeepTheEngine(): Unit = {
    for (kv <- Seq(
        Seq.empty[(String, String)],
        // Encrypted shuffle files: Spark writes them, the engine moves them as they are and
        // Spark's reader decrypts.
        Seq("spark.io.encryption.enabled" -> "true"),
        Seq("spark.authenticate" -> "true"),
        Seq("spark.network.crypto.enabled" -> "false"),
        // TLS for the UI only: RPC/shuffle TLS explicitly off.
        Seq("spark.ssl.enabled" -> "true", "spark.ssl.rpc.enabled" -> "false"),
        Seq("spark.ssl.ui.enabled" -> "true"),
        // Migrated map outputs are registered with the receiving executor's engine.
        Seq(
          "spark.decommission.enabled" -> "true",
          "spark.storage.decommission.enabled" -> "true",
          "spark.storage.decommission.shuffleBlocks.enabled" -> "true"),
        Seq(
          "spark.dynamicAllocation.enabled" -> "true",
          "spark.dynamicAllocation.shuffleTracking.enabled" -> "true"),
        // The external shuffle service serves the files after their executor has left; the
        // engines serve them before (NativeBlockStoreClient).
        Seq("spark.shuffle.service.enabled" -> "true"),
        Seq("spark.shuffle.service.enabled" -> "true", "spark.dynamicAllocation.enabled" -> "true")
      )) {
      val p = policy(kv: _*)
      assertEquals(s"$kv", None, p.reasonToHandOverAll)
      assertEquals(s"$kv", None, p.encryption)
    }
  }

  /** Hands every shuffle over, naming `setting` in its reason, with no encryption involved. */
  private def handsOverFor(setting: String, kv: (String, String)*): Unit = {
    val p = policy(kv: _*)
    val reason = p.reasonToHandOverAll
    assertTrue(s"$kv: $reason", reason.exists(_.startsWith(setting)))
    assertEquals(s"$kv: every shuffle", reason, p.reasonToHandOver(null))
    assertEquals(s"$kv", None, p.encryption)
  }

  @Test def filesServedOrMovedBySparkHandEveryShuffleToSpark(): Unit = {
    // Push-based shuffle merges blocks remotely.
    handsOverFor("spark.shuffle.push.enabled=true", "spark.shuffle.push.enabled" -> "true")
    // A custom shuffle IO plugin may not write local .data/.index files.
    handsOverFor(
      "spark.shuffle.sort.io.plugin.class=com.example.RemoteShuffleDataIO",
      "spark.shuffle.sort.io.plugin.class" -> "com.example.RemoteShuffleDataIO")
    // Each rule on its own, whatever else is set that keeps the engine.
    handsOverFor(
      "spark.shuffle.push.enabled=true",
      "spark.shuffle.push.enabled" -> "true",
      "spark.io.encryption.enabled" -> "true",
      "spark.shuffle.service.enabled" -> "false"
    )
  }

  @Test def theSameSettingsOffOrAtSparksDefaultKeepTheEngine(): Unit = {
    for (kv <- Seq(
        Seq("spark.shuffle.service.enabled" -> "false"),
        Seq("spark.shuffle.push.enabled" -> "false"),
        Seq(
          "spark.shuffle.sort.io.plugin.class" ->
            "org.apache.spark.shuffle.sort.io.LocalDiskShuffleDataIO")
      )) {
      assertEquals(s"$kv", None, policy(kv: _*).reasonToHandOverAll)
    }
  }

  @Test def disabledAndMissingLibraryComeFirst(): Unit = {
    val c = new SparkConf(false).set("spark.network.crypto.enabled", "true")
      .set("spark.shuffle.rdma.enabled", "false")
    assertEquals(
      Some("spark.shuffle.rdma.enabled=false"),
      new DefaultFallbackPolicy(c, RdmaShuffleConf(c), None).reasonToHandOverAll)
    val d = new SparkConf(false).set("spark.network.crypto.enabled", "true")
    assertEquals(
      Some("native library unavailable"),
      new DefaultFallbackPolicy(d, RdmaShuffleConf(d), Some("no lib")).reasonToHandOverAll)
  }
}
