/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma.jobs

import java.io.File

import org.apache.spark.HashPartitioner
import org.apache.spark.sql.SparkSession

/**
 * A shuffle job that stays up after its work until told to stop, so that a test can read the
 * executors' metrics sinks while the executors still run (tests/spark/test_metrics.py). It knows
 * nothing of the plugin.
 *
 * Two shuffles: one of small blocks (about 2 KB each) and one of large blocks (about 1 MB
 * each), so that both of a transport's paths (small blocks inline, large ones pulled) carry
 * data. Prints
 * {{{
 *   DIGEST job=<name> records=<n> sum=<hex>
 *   METRICS_JOB_DONE
 * }}}
 * then waits until `<release file>` exists (bounded by `<max wait s>`, default 600), and stops.
 *
 * Usage: MetricsJob <release file> [max wait s]
 */
object MetricsJob {

  def main(args: Array[String]): Unit = {
    require(args.nonEmpty, "usage: MetricsJob <release file> [max wait s]")
    val release = new File(args(0))
    val maxWaitMs = (if (args.length > 1) args(1).toLong else 600L) * 1000
    val spark = SparkSession.builder().appName("rdma-shuffle-metrics-job").getOrCreate()
    val sc = spark.sparkContext

    // 8 maps x 8 reduces of 2 000 records of ~10 bytes: blocks of a few KB.
    val small = sc.parallelize(0 until 8, 8).flatMap { p =>
      Iterator.tabulate(2000)(i => (p * 2000 + i, i.toLong))
    }.partitionBy(new HashPartitioner(8))
    println(s"DIGEST job=small ${ShuffleJobs.digestOf(small) { case (k, v) => k * 31L + v }}")

    // 4 maps x 4 reduces of 4 MiB of random bytes per map: blocks of about 1 MiB.
    val large = sc.parallelize(0 until 4, 4).flatMap { p =>
      val rnd = new java.util.Random(3000L + p)
      Iterator.tabulate(64) { i =>
        val v = new Array[Byte](64 * 1024)
        rnd.nextBytes(v)
        (p * 64 + i, v)
      }
    }.partitionBy(new HashPartitioner(4))
    println(s"DIGEST job=large ${ShuffleJobs.digestOf(large) { case (k, v) =>
        k * 31L + ShuffleJobs.hash64(v)
      }}")
    println("METRICS_JOB_DONE")
    System.out.flush()

    val deadline = System.currentTimeMillis() + maxWaitMs
    while (!release.exists() && System.currentTimeMillis() < deadline) Thread.sleep(100)
    if (!release.exists()) println(s"METRICS_JOB_RELEASE_TIMEOUT after ${maxWaitMs / 1000} s")
    spark.stop()
  }
}
