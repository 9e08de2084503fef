/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.apache.spark.{ShuffleDependency, SparkConf}

/**
 * Decides, per shuffle and on the driver, whether a shuffle goes to Spark's own sort shuffle.
 * One method: a reason to hand over, or `None` to serve it with the plugin.
 */
trait FallbackPolicy {

  /** Why `dependency` must be handed to Spark's sort shuffle, or `None`. */
  def reasonToHandOver(dependency: ShuffleDependency[_, _, _]): Option[String]

  /**
   * A reason, known before any shuffle, that hands every shuffle of the application to Spark's
   * sort shuffle. The manager then starts no engine at all (no port is opened).
   */
  def reasonToHandOverAll: Option[String] = None
}

/**
 * The default policy: hand over when the plugin is disabled or the native library is missing,
 * when the application asks Spark to encrypt traffic between executors (the engine does not
 * encrypt yet, and must never move blocks in clear text in silence; see
 * [[DefaultFallbackPolicy.encryptionRequested]]), and whenever Spark serves or moves shuffle
 * files by other means the engine cannot follow:
 *  - push-based shuffle merges blocks on remote shuffle services, where no engine runs;
 *  - a custom `spark.shuffle.sort.io.plugin.class` may not write local `.data/.index` files.
 * Not among them: the external shuffle service (`spark.shuffle.service.enabled`), which serves
 * the same files after their executor has left while engines serve them before (see
 * [[NativeBlockStoreClient]]), and shuffle-block migration on decommission, whose migrated
 * outputs are registered with the receiving executor's engine as they arrive (see
 * [[CheckedIndexShuffleBlockResolver]]).
 *
 * @param nativeFailure why the native library did not load, if it did not
 */
class DefaultFallbackPolicy(
    conf: SparkConf,
    settings: RdmaShuffleConf,
    nativeFailure: Option[String])
  extends FallbackPolicy {

  /** The setting asking for encrypted traffic, if any (see the companion). */
  val encryption: Option[String] = DefaultFallbackPolicy.encryptionRequested(conf)

  private val staticReason: Option[String] = {
    val localDiskIo = "org.apache.spark.shuffle.sort.io.LocalDiskShuffleDataIO"
    if (!settings.enabled) {
      Some(s"${RdmaShuffleConf.EnabledKey}=false")
    } else if (nativeFailure.isDefined) {
      Some("native library unavailable")
    } else if (encryption.isDefined) {
      encryption.map(s =>
        s"$s asks for encrypted traffic between executors, which the RDMA engine does not provide")
    } else if (conf.getBoolean("spark.shuffle.push.enabled", false)) {
      Some("spark.shuffle.push.enabled=true (push-based shuffle)")
    } else if (conf.get("spark.shuffle.sort.io.plugin.class", localDiskIo) != localDiskIo) {
      Some(s"spark.shuffle.sort.io.plugin.class=${conf.get("spark.shuffle.sort.io.plugin.class")}")
    } else {
      None
    }
  }

  override def reasonToHandOver(dependency: ShuffleDependency[_, _, _]): Option[String] =
    staticReason

  override def reasonToHandOverAll: Option[String] = staticReason
}

/** The settings behind [[DefaultFallbackPolicy]]'s decisions. */
object DefaultFallbackPolicy {

  /**
   * The setting (as `key=value`) by which the application asks Spark to encrypt the traffic
   * between executors, if any:
   *  - `spark.network.crypto.enabled=true` (AES-based encryption of RPC and block transfer);
   *  - `spark.authenticate.enableSaslEncryption=true` (SASL encryption of the same);
   *  - TLS for RPC and block transfer: `spark.ssl.rpc.enabled`, which follows
   *    `spark.ssl.enabled` unless set (Spark 4). Spark 3.5 has no TLS for block transfer, but
   *    a user who turns on `spark.ssl.enabled` asked for TLS, so the rule is the same there.
   * `spark.io.encryption.enabled` is not among them: it encrypts the shuffle files, which the
   * engine moves as they are and Spark's reader decrypts.
   */
  def encryptionRequested(conf: SparkConf): Option[String] = {
    def on(key: String) = conf.getOption(key).exists(_.trim.equalsIgnoreCase("true"))
    val ssl = conf.getOption("spark.ssl.rpc.enabled") match {
      case Some(v) =>
        if (v.trim.equalsIgnoreCase("true")) Some("spark.ssl.rpc.enabled=true") else None
      case None => if (on("spark.ssl.enabled")) Some("spark.ssl.enabled=true") else None
    }
    Seq("spark.network.crypto.enabled", "spark.authenticate.enableSaslEncryption")
      .find(on).map(k => s"$k=true").orElse(ssl)
  }
}
