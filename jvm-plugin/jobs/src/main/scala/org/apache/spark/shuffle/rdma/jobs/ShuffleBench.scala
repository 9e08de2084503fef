/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma.jobs

import org.apache.spark.{Partitioner, SparkContext}
import org.apache.spark.rdd.RDD
import org.apache.spark.sql.{Row, SparkSession}
import org.apache.spark.sql.types.{BinaryType, StructField, StructType}

/**
 * The Spark shuffle benchmark of docs/benchmarks.md as one ordinary Spark application (it does not
 * reference the plugin; scripts/bench-spark.sh runs it once per mode and alternates modes):
 * N records (13 M by default) of a 10-byte random key and a 100-byte random value, 32 map x 32
 * reduce partitions, shuffled by three jobs:
 *
 *  - `sortByKey`: range partitioner (with its sampling job), keys in unsigned byte order;
 *  - `partitionBy`: hash partitioning of the key bytes into 32 ([[BytesHashPartitioner]]:
 *    Spark's `HashPartitioner` refuses array keys, whose `hashCode` is their identity);
 *  - `repartition`: DataFrame `repartition(32)` (round-robin) of (key, value) binary columns.
 *
 * The input is generated inside each job's map stage (seeded per partition, so every run and
 * both modes shuffle the same bytes). Each job is timed by the application itself, after the
 * executors are registered and every selected job ran once untimed at 1/8 of the size (class
 * loading, connections and JIT), so cluster start-up and warm-up are not part of any number.
 * Output per job:
 * {{{
 *   BENCH job=<name> wall_ms=.. start_epoch_ms=.. end_epoch_ms=.. records=.. digest=<16 hex> write_bytes=.. remote_bytes=.. local_bytes=.. remote_blocks=.. fetch_wait_ms=..
 * }}}
 * `start_epoch_ms`/`end_epoch_ms` (wall clock) let a harness attribute what it samples outside
 * the application, such as executor threads' CPU, to the timed job.
 * `fetch_wait_ms` is Spark's own `shuffleReadMetrics.fetchWaitTime` summed over the job's tasks;
 * `digest` is an order-independent hash of the job's output records, equal across modes.
 *
 * Usage: ShuffleBench [records] [jobs]   (jobs: comma list of sortByKey,partitionBy,repartition)
 */
object ShuffleBench {

  /** Jobs in the order they run. */
  val AllJobs: Seq[String] = Seq("sortByKey", "partitionBy", "repartition")

  /** Map and reduce partitions of every job. */
  val Partitions = 32

  /** The untimed warm-up runs each selected job over `records / WarmUpFraction` records. */
  val WarmUpFraction = 8

  /** Executors the application waits for before timing anything (local-cluster[2,..]). */
  private val ExpectedExecutors = 2

  def main(args: Array[String]): Unit = {
    val records = if (args.length > 0) args(0).toLong else 13000000L
    require(records > 0, s"records must be positive, got $records")
    val jobs = if (args.length > 1) args(1).split(",").map(_.trim).toSeq else AllJobs
    jobs.foreach(j =>
      require(AllJobs.contains(j), s"unknown job '$j'; jobs: ${AllJobs.mkString(",")}"))
    val spark = SparkSession.builder().appName(s"rdma-shuffle-bench-$records").getOrCreate()
    val sc = spark.sparkContext
    waitForExecutors(sc, ExpectedExecutors, timeoutMs = 180000)
    // Warm-up, untimed: every selected job once at 1/WarmUpFraction of the size. Executors'
    // first shuffles pay for class loading, connection set-up and JIT compilation of the job's
    // own code paths (C2 alone is about a quarter of executor CPU on 2 cores, and the largest
    // source of run-to-run spread); the measured jobs should show the shuffle, not those.
    val warmUpRecords = math.max(records / WarmUpFraction, Partitions.toLong)
    jobs.foreach { job =>
      val (n, _) = run(spark, job, warmUpRecords)
      require(n == warmUpRecords, s"warm-up $job produced $n records, expected $warmUpRecords")
    }
    val metrics = new ShuffleMetricsListener
    sc.addSparkListener(metrics)
    jobs.foreach { job =>
      ListenerBus.drain(sc)
      metrics.reset()
      val startEpochMs = System.currentTimeMillis()
      val start = System.nanoTime()
      val (n, digest) = run(spark, job, records)
      val wallMs = (System.nanoTime() - start) / 1000000
      val endEpochMs = System.currentTimeMillis()
      ListenerBus.drain(sc)
      require(n == records, s"$job produced $n records, expected $records")
      println(f"BENCH job=$job wall_ms=$wallMs start_epoch_ms=$startEpochMs end_epoch_ms=$endEpochMs records=$n digest=$digest%016x ${metrics.render}")
    }
    spark.stop()
  }

  /** Runs one job over `records` records: (records out, digest). */
  private def run(spark: SparkSession, job: String, records: Long): (Long, Long) = job match {
    case "sortByKey" => sortByKey(spark.sparkContext, records)
    case "partitionBy" => partitionBy(spark.sparkContext, records)
    case "repartition" => repartition(spark, records)
  }

  private def waitForExecutors(sc: SparkContext, n: Int, timeoutMs: Long): Unit = {
    val deadline = System.currentTimeMillis() + timeoutMs
    // getExecutorInfos includes the driver.
    while (sc.statusTracker.getExecutorInfos.length < n + 1) {
      require(
        System.currentTimeMillis() < deadline,
        s"only ${sc.statusTracker.getExecutorInfos.length - 1} of $n executors registered " +
          s"within ${timeoutMs / 1000} s")
      Thread.sleep(200)
    }
  }

  /** The input: `records` (key, value) pairs over [[Partitions]] map partitions. */
  def input(sc: SparkContext, records: Long): RDD[(Array[Byte], Array[Byte])] = {
    val parts = Partitions
    sc.parallelize(0 until parts, parts).flatMap { p =>
      // Records [p * records / parts, (p + 1) * records / parts): exact total for any N.
      val from = p * records / parts
      val until = (p + 1) * records / parts
      val rnd = new java.util.Random(0x5eed0000L + p)
      Iterator.range(0, (until - from).toInt).map { _ =>
        val k = new Array[Byte](10)
        val v = new Array[Byte](100)
        rnd.nextBytes(k)
        rnd.nextBytes(v)
        (k, v)
      }
    }
  }

  private def recordHash(k: Array[Byte], v: Array[Byte]): Long =
    ShuffleJobs.hash64(k) * 31 + ShuffleJobs.hash64(v)

  /** Count and hash sum of an RDD of pairs, one pass over the reduce side. */
  private def summarize(rdd: RDD[(Array[Byte], Array[Byte])]): (Long, Long) =
    rdd.mapPartitions { it =>
      var n = 0L
      var s = 0L
      it.foreach { case (k, v) => n += 1; s += recordHash(k, v) }
      Iterator.single((n, s))
    }.collect().foldLeft((0L, 0L)) { case ((n, s), (n1, s1)) => (n + n1, s + s1) }

  def sortByKey(sc: SparkContext, records: Long): (Long, Long) = {
    implicit val ord: Ordering[Array[Byte]] = ShuffleJobs.BytesOrdering
    val sorted = input(sc, records).sortByKey(ascending = true, numPartitions = Partitions)
    // Checks the order inside every partition on the way (the ranges are the partitioner's).
    val perPart = sorted.mapPartitions { it =>
      var n = 0L
      var s = 0L
      var prev: Array[Byte] = null
      it.foreach { case (k, v) =>
        if (prev != null && ShuffleJobs.BytesOrdering.compare(prev, k) > 0) {
          throw new IllegalStateException("sortByKey output out of order")
        }
        prev = k
        n += 1
        s += recordHash(k, v)
      }
      Iterator.single((n, s))
    }.collect()
    (perPart.map(_._1).sum, perPart.map(_._2).sum)
  }

  def partitionBy(sc: SparkContext, records: Long): (Long, Long) =
    summarize(input(sc, records).partitionBy(new BytesHashPartitioner(Partitions)))

  def repartition(spark: SparkSession, records: Long): (Long, Long) = {
    val schema = StructType(Seq(StructField("key", BinaryType), StructField("value", BinaryType)))
    val rows = input(spark.sparkContext, records).map { case (k, v) => Row(k, v) }
    val df = spark.createDataFrame(rows, schema).repartition(Partitions)
    // InternalRow straight from the plan: no conversion back to Row on the reduce side.
    val perPart = df.queryExecution.toRdd.mapPartitions { it =>
      var n = 0L
      var s = 0L
      it.foreach { r => n += 1; s += recordHash(r.getBinary(0), r.getBinary(1)) }
      Iterator.single((n, s))
    }.collect()
    (perPart.map(_._1).sum, perPart.map(_._2).sum)
  }
}

/** `HashPartitioner` for byte-array keys: partition = content hash of the key, mod N. */
final class BytesHashPartitioner(override val numPartitions: Int) extends Partitioner {
  override def getPartition(key: Any): Int = {
    val h = java.util.Arrays.hashCode(key.asInstanceOf[Array[Byte]]) % numPartitions
    if (h < 0) h + numPartitions else h
  }
  override def equals(o: Any): Boolean = o match {
    case p: BytesHashPartitioner => p.numPartitions == numPartitions
    case _ => false
  }
  override def hashCode(): Int = numPartitions
}
