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
}

/**
 * The default policy: hand over when the plugin is disabled or the native library is missing,
 * and whenever Spark serves or moves shuffle files by other means the engine cannot follow:
 *  - the external shuffle service serves files after their executor is gone, and push-based
 *    shuffle merges them remotely, while an engine dies with its executor;
 *  - a custom `spark.shuffle.sort.io.plugin.class` may not write local `.data/.index` files;
 *  - decommissioning migrates shuffle files to executors whose engine never registered them.
 *
 * @param nativeFailure why the native library did not load, if it did not
 */
class DefaultFallbackPolicy(conf: SparkConf, settings: RdmaShuffleConf, nativeFailure: Option[String])
  extends FallbackPolicy {

  private val staticReason: Option[String] = {
    val localDiskIo = "org.apache.spark.shuffle.sort.io.LocalDiskShuffleDataIO"
    if (!settings.enabled) {
      Some(s"${RdmaShuffleConf.Enabled.key}=false")
    } else if (nativeFailure.isDefined) {
      Some("native library unavailable")
    } else if (conf.getBoolean("spark.shuffle.service.enabled", false)) {
      Some("spark.shuffle.service.enabled=true (shuffle files are served by the external " +
        "shuffle service)")
    } else if (conf.getBoolean("spark.shuffle.push.enabled", false)) {
      Some("spark.shuffle.push.enabled=true (push-based shuffle)")
    } else if (conf.get("spark.shuffle.sort.io.plugin.class", localDiskIo) != localDiskIo) {
      Some(s"spark.shuffle.sort.io.plugin.class=${conf.get("spark.shuffle.sort.io.plugin.class")}")
    } else if (conf.getBoolean("spark.decommission.enabled", false) &&
        conf.getBoolean("spark.storage.decommission.shuffleBlocks.enabled", false)) {
      Some("shuffle block migration on decommission is enabled")
    } else {
      None
    }
  }

  override def reasonToHandOver(dependency: ShuffleDependency[_, _, _]): Option[String] =
    staticReason
}
