/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma.jobs

import java.nio.ByteBuffer
import java.util.concurrent.atomic.AtomicLong

import scala.util.hashing.MurmurHash3

import org.apache.spark.{HashPartitioner, Partitioner, SparkConf, SparkContext}
import org.apache.spark.rdd.RDD
import org.apache.spark.scheduler.{SparkListener, SparkListenerTaskEnd}
import org.apache.spark.sql.SparkSession
import org.apache.spark.sql.functions._

/**
 * Ordinary Spark applications used to compare Spark's default shuffle with the plugin. They do
 * not reference the plugin: the harness (tests/spark) runs each twice, changing only
 * `spark.shuffle.manager` and `--jars`, and compares the printed digests.
 *
 * Every job generates its input deterministically (seeded per partition), so two runs produce
 * the same output, and prints:
 * {{{
 *   DIGEST job=<name> records=<n> sum=<16 hex digits> [check=...]
 *   SHUFFLE_METRICS job=<name> wall_ms=.. write_bytes=.. remote_bytes=.. local_bytes=.. remote_blocks=.. fetch_wait_ms=.. records_read=..
 * }}}
 * The digest is order-independent (a sum of 64-bit record hashes) so that it does not depend on
 * how partitions were scheduled; jobs whose output order matters check it themselves.
 *
 * Usage: ShuffleJobs <all|job[,job...]> [scale], jobs: wordcount, terasort, sql, sparse, bigblock
 * (and, not in `all`, hugerequest: see [[hugeRequest]])
 */
object ShuffleJobs {

  /** Every job, in the order `all` runs them. */
  val AllJobs: Seq[String] = Seq("wordcount", "terasort", "sql", "sparse", "bigblock")

  def main(args: Array[String]): Unit = {
    require(
      args.nonEmpty,
      s"usage: ShuffleJobs <all|job[,job...]> [scale]; jobs: ${AllJobs.mkString(", ")}")
    val jobs = if (args(0) == "all") AllJobs else args(0).split(",").map(_.trim).toSeq
    jobs.foreach(j =>
      require(
        AllJobs.contains(j) || j == "hugerequest",
        s"unknown job '$j'; jobs: ${AllJobs.mkString(", ")}, hugerequest"))
    val scale = if (args.length > 1) args(1).toDouble else 1.0
    // Several jobs share one application: on 2 cores, starting the executors of a
    // local-cluster costs more than most of the jobs themselves.
    val spark =
      SparkSession.builder().appName(s"rdma-shuffle-jobs-${jobs.mkString("+")}").getOrCreate()
    run(spark, jobs, scale)
    spark.stop()
  }

  /**
   * Runs `jobs` at `scale` in `spark`'s application, printing each one's `DIGEST` and
   * `SHUFFLE_METRICS` lines; the session stays open (YarnJob runs more after them).
   */
  def run(spark: SparkSession, jobs: Seq[String], scale: Double): Unit = {
    val sc = spark.sparkContext
    // A test hook: a listener ahead of the metrics one that takes this long per task end, so
    // the bus lags behind the jobs as on a loaded machine. The tests that compare the printed
    // metrics exactly set it; they then fail whenever a job prints before the bus drained.
    val listenerDelayMs = sc.getConf.getLong("spark.rdma.jobs.listenerDelayMs", 0L)
    if (listenerDelayMs > 0) sc.addSparkListener(new SlowTaskEndListener(listenerDelayMs))
    val metrics = new ShuffleMetricsListener
    sc.addSparkListener(metrics)
    jobs.foreach { job =>
      ListenerBus.drain(sc) // the previous job's task ends counted before the reset
      metrics.reset()
      val start = System.nanoTime()
      val digest = job match {
        case "wordcount" => wordCount(sc, scale)
        case "terasort" => teraSort(sc, scale)
        case "sql" => sqlAqe(spark, scale)
        case "sparse" => sparse(sc, scale)
        case "bigblock" => bigBlock(sc, scale)
        case "hugerequest" => hugeRequest(sc, scale)
      }
      val wallMs = (System.nanoTime() - start) / 1000000
      // Task-end events arrive asynchronously; every one of this job's counted before printing.
      ListenerBus.drain(sc)
      println(s"DIGEST job=$job $digest")
      println(s"SHUFFLE_METRICS job=$job wall_ms=$wallMs ${metrics.render}")
    }
    sc.removeSparkListener(metrics)
  }

  // ------------------------------------------------------------------------------------------
  // Digest helpers

  /** An order-independent digest: count and the 64-bit sum of per-record hashes. */
  final case class Digest(records: Long, sum: Long, check: String = "") {
    def +(o: Digest): Digest = Digest(records + o.records, sum + o.sum, check)
    override def toString: String =
      f"records=$records sum=$sum%016x" + (if (check.nonEmpty) s" check=$check" else "")
  }

  def hash64(bytes: Array[Byte]): Long = {
    val a = MurmurHash3.bytesHash(bytes, 0x3c074a61)
    val b = MurmurHash3.bytesHash(bytes, 0x7d2f11e3)
    (a.toLong << 32) ^ (b.toLong & 0xffffffffL)
  }

  def hashString(s: String): Long = hash64(s.getBytes("UTF-8"))

  def digestOf[T](rdd: RDD[T])(h: T => Long): Digest =
    rdd.mapPartitions { it =>
      var n = 0L
      var s = 0L
      it.foreach { t => n += 1; s += h(t) }
      Iterator.single((n, s))
    }.collect().foldLeft(Digest(0, 0)) { case (d, (n, s)) => Digest(d.records + n, d.sum + s) }

  // ------------------------------------------------------------------------------------------
  // Jobs

  /** RDD word count: Zipf-like words over 8 map partitions, reduceByKey into 8. */
  def wordCount(sc: SparkContext, scale: Double): Digest = {
    val parts = 8
    val perPart = (125000 * scale).toInt
    val words = sc.parallelize(0 until parts, parts).flatMap { p =>
      val rnd = new java.util.Random(1000L + p)
      Iterator.fill(perPart) {
        // Squaring a uniform variate skews toward small ids: a few very frequent words.
        val u = rnd.nextDouble()
        "w" + (u * u * 50000).toInt
      }
    }
    val counts = words.map(w => (w, 1L)).reduceByKey(_ + _, parts)
    digestOf(counts) { case (w, c) => hashString(w) * 31 + c * 0x9e3779b97f4a7c15L }
  }

  /** Unsigned lexicographic order of byte arrays (TeraSort's key order). */
  object BytesOrdering extends Ordering[Array[Byte]] {
    override def compare(x: Array[Byte], y: Array[Byte]): Int = {
      val n = math.min(x.length, y.length)
      var i = 0
      while (i < n) {
        val c = (x(i) & 0xff) - (y(i) & 0xff)
        if (c != 0) return c
        i += 1
      }
      x.length - y.length
    }
  }

  /**
   * TeraSort-like: 1 M records (at scale 1) of a 10-byte random key and a 100-byte random value,
   * sortByKey (range partitioner) into 8 partitions. Checks the global order itself.
   */
  def teraSort(sc: SparkContext, scale: Double): Digest = {
    val parts = 8
    val perPart = (125000 * scale).toInt
    val records = sc.parallelize(0 until parts, parts).flatMap { p =>
      val rnd = new java.util.Random(2000L + p)
      Iterator.fill(perPart) {
        val k = new Array[Byte](10)
        val v = new Array[Byte](100)
        rnd.nextBytes(k)
        rnd.nextBytes(v)
        (k, v)
      }
    }
    implicit val ord: Ordering[Array[Byte]] = BytesOrdering
    val sorted = records.sortByKey(ascending = true, numPartitions = parts)
    // Per partition: count, hash sum, first and last key, and whether it is sorted inside.
    val summaries = sorted.mapPartitionsWithIndex { (i, it) =>
      var n = 0L
      var s = 0L
      var first: Array[Byte] = null
      var prev: Array[Byte] = null
      var inOrder = true
      it.foreach { case (k, v) =>
        if (first == null) first = k
        if (prev != null && BytesOrdering.compare(prev, k) > 0) inOrder = false
        prev = k
        n += 1
        s += hash64(k) * 31 + hash64(v)
      }
      Iterator.single((i, n, s, Option(first), Option(prev), inOrder))
    }.collect().sortBy(_._1)
    val nonEmpty = summaries.filter(_._2 > 0)
    val acrossOk = nonEmpty.zip(nonEmpty.drop(1)).forall { case (a, b) =>
      BytesOrdering.compare(a._5.get, b._4.get) <= 0
    }
    val sortedOk = acrossOk && summaries.forall(_._6)
    Digest(summaries.map(_._2).sum, summaries.map(_._3).sum, s"sorted=$sortedOk")
  }

  /**
   * DataFrame groupBy + join with AQE: partition coalescing (200 shuffle partitions of small
   * data) and a skew join (one join key holds a third of the fact rows). The thresholds are
   * lowered so that AQE's optimisations trigger on this small data; batch fetch of contiguous
   * blocks (shuffle_S_M_R1_R2) is on by default.
   */
  def sqlAqe(spark: SparkSession, scale: Double): Digest = {
    spark.conf.set("spark.sql.adaptive.enabled", "true")
    spark.conf.set("spark.sql.adaptive.coalescePartitions.enabled", "true")
    spark.conf.set("spark.sql.adaptive.skewJoin.enabled", "true")
    spark.conf.set("spark.sql.adaptive.advisoryPartitionSizeInBytes", "256k")
    spark.conf.set("spark.sql.adaptive.skewJoin.skewedPartitionThresholdInBytes", "512k")
    spark.conf.set("spark.sql.adaptive.skewJoin.skewedPartitionFactor", "2")
    spark.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    spark.conf.set("spark.sql.shuffle.partitions", "200")
    val n = (500000 * scale).toLong
    val facts = spark.range(0, n, 1, 8).select(
      col("id"),
      // A third of the rows share key 7: the skewed join partition.
      when(col("id") % 3 === 0, lit(7L)).otherwise(pmod(hash(col("id")), lit(20000)).cast("long"))
        .as("k"),
      (pmod(hash(col("id"), lit(17)), lit(1000))).cast("long").as("amount"),
      concat(lit("payload-"), col("id").cast("string")).as("payload")
    )
    val dims = spark.range(0, 20000, 1, 4).select(
      col("id").as("k"),
      concat(lit("name-"), (col("id") % 997).cast("string")).as("name"),
      (col("id") % 13).as("grp"))
    val joined = facts.join(dims, "k")
    val result = joined.groupBy("grp", "name")
      .agg(count(lit(1)).as("cnt"), sum("amount").as("total"), max(length(col("payload"))).as("ml"))
    val rows = result.collect()
    val plan = result.queryExecution.executedPlan.toString
    val skew = plan.contains("skew=true")
    val coalesced = plan.contains("coalesced")
    val rowHashSum = rows.map(r => hashString(r.mkString("|"))).sum
    Digest(rows.length.toLong, rowHashSum, s"aqe_skew_join=$skew,aqe_coalesced=$coalesced")
  }

  /** Routes every key to one of 5 partitions out of N: almost every block is empty. */
  final class SparsePartitioner(override val numPartitions: Int) extends Partitioner {
    override def getPartition(key: Any): Int =
      (math.abs(key.hashCode() % 5) * (numPartitions / 5)) % numPartitions
    override def equals(o: Any): Boolean = o match {
      case s: SparsePartitioner => s.numPartitions == numPartitions
      case _ => false
    }
    override def hashCode(): Int = numPartitions
  }

  /**
   * 400 reduce partitions of which 5 receive data: 98.75 % of the blocks are empty. (Above 200
   * partitions Spark leaves the bypass-merge writer; each extra reduce task costs ~20-40 ms of
   * scheduling on 2 cores, which is why it is not 2000.)
   */
  def sparse(sc: SparkContext, scale: Double): Digest = {
    val maps = 4
    val perMap = (50000 * scale).toInt
    val data = sc.parallelize(0 until maps, maps).flatMap { p =>
      val rnd = new java.util.Random(3000L + p)
      Iterator.fill(perMap)((rnd.nextInt(100000), rnd.nextLong()))
    }
    val reduced = data.reduceByKey(new SparsePartitioner(400), _ ^ _)
    // One pass over the reduce side: every extra action would rerun its 400 tasks.
    val perPart = reduced.mapPartitions { it =>
      var n = 0L
      var s = 0L
      it.foreach { case (k, v) => n += 1; s += k.toLong * 0x9e3779b97f4a7c15L + v }
      Iterator.single((n, s))
    }.collect()
    Digest(
      perPart.map(_._1).sum,
      perPart.map(_._2).sum,
      s"nonempty_partitions=${perPart.count(_._1 > 0)}")
  }

  /**
   * One map task writes two shuffle blocks of 210 MiB of incompressible bytes (reduce partitions
   * 0 and 1). Both reduce tasks run at once, one per executor, so one of the two big blocks is
   * fetched remotely (the harness disables reduce locality). The values are streamed, never held.
   */
  def bigBlock(sc: SparkContext, scale: Double): Digest =
    bigBlocks(sc, maps = 1, chunks = 2 * math.max(1, (210 * scale).toInt), key = _ % 2)

  /**
   * Four map tasks each write a block of 1100 MiB x scale for reduce partition 0 (and 1 MiB for
   * partition 1), so the reduce task of partition 0 reads four big blocks, two of them (when
   * the maps split evenly) from the other executor. Outside the CI suite
   * (scripts/spark-huge-block.sh): with `spark.reducer.maxSizeInFlight` large, those two form
   * one fetch request of more than 2 GiB.
   */
  def hugeRequest(sc: SparkContext, scale: Double): Digest = {
    val n = math.max(1, (1100 * scale).toInt)
    bigBlocks(sc, maps = 4, chunks = n + 1, key = i => if (i == n) 1 else 0)
  }

  private def bigBlocks(sc: SparkContext, maps: Int, chunks: Int, key: Int => Int): Digest = {
    val chunk = 1 << 20
    val data = sc.parallelize(0 until maps, maps).flatMap { m =>
      var x = 0x2545f4914f6cdd1dL + m
      Iterator.range(0, chunks).map { i =>
        val buf = ByteBuffer.allocate(chunk)
        while (buf.hasRemaining) {
          // xorshift64*: fast and incompressible enough for LZ4/zstd.
          x ^= x >>> 12; x ^= x << 25; x ^= x >>> 27
          buf.putLong(x * 0x2545f4914f6cdd1dL)
        }
        (key(i), buf.array())
      }
    }
    val shuffled = data.partitionBy(new HashPartitioner(2))
    val perPart = shuffled.mapPartitionsWithIndex { (p, it) =>
      var n = 0L
      var s = 0L
      var bytes = 0L
      it.foreach { case (k, v) => n += 1; s += hash64(v) + k; bytes += v.length }
      Iterator.single((n, s, bytes))
    }.collect()
    Digest(
      perPart.map(_._1).sum,
      perPart.map(_._2).sum,
      s"block_bytes=${perPart.map(_._3).mkString("/")}")
  }
}

/**
 * Takes `delayMs` over every task end: listeners of one queue get each event in turn, so the
 * ones added after it see task ends that late (see `spark.rdma.jobs.listenerDelayMs`).
 */
class SlowTaskEndListener(delayMs: Long) extends SparkListener {
  override def onTaskEnd(end: SparkListenerTaskEnd): Unit = Thread.sleep(delayMs)
}

/** Sums shuffle metrics of all tasks (the numbers demo.sh and the harness print). */
class ShuffleMetricsListener extends SparkListener {
  private val writeBytes = new AtomicLong
  private val remoteBytes = new AtomicLong
  private val localBytes = new AtomicLong
  private val remoteBlocks = new AtomicLong
  private val fetchWaitMs = new AtomicLong
  private val recordsRead = new AtomicLong
  // Where the time goes, split by the side of the shuffle a task is on (a task that writes
  // shuffle output counts as map side, every other task as reduce side): summed task run time,
  // CPU time and GC time. A wall-time gap between the two shuffles shows up in one of these.
  private val mapRunMs = new AtomicLong
  private val mapCpuMs = new AtomicLong
  private val reduceRunMs = new AtomicLong
  private val reduceCpuMs = new AtomicLong
  private val gcMs = new AtomicLong

  private def all = Seq(
    writeBytes,
    remoteBytes,
    localBytes,
    remoteBlocks,
    fetchWaitMs,
    recordsRead,
    mapRunMs,
    mapCpuMs,
    reduceRunMs,
    reduceCpuMs,
    gcMs)

  def reset(): Unit = all.foreach(_.set(0))

  override def onTaskEnd(end: SparkListenerTaskEnd): Unit = {
    val m = end.taskMetrics
    if (m != null) {
      writeBytes.addAndGet(m.shuffleWriteMetrics.bytesWritten)
      remoteBytes.addAndGet(m.shuffleReadMetrics.remoteBytesRead)
      localBytes.addAndGet(m.shuffleReadMetrics.localBytesRead)
      remoteBlocks.addAndGet(m.shuffleReadMetrics.remoteBlocksFetched)
      fetchWaitMs.addAndGet(m.shuffleReadMetrics.fetchWaitTime)
      recordsRead.addAndGet(m.shuffleReadMetrics.recordsRead)
      val mapSide =
        m.shuffleWriteMetrics.bytesWritten > 0 || m.shuffleWriteMetrics.recordsWritten > 0
      (if (mapSide) mapRunMs else reduceRunMs).addAndGet(m.executorRunTime)
      (if (mapSide) mapCpuMs else reduceCpuMs).addAndGet(m.executorCpuTime / 1000000)
      gcMs.addAndGet(m.jvmGCTime)
    }
  }

  def render: String =
    s"write_bytes=${writeBytes.get} remote_bytes=${remoteBytes.get} local_bytes=${localBytes.get} " +
      s"remote_blocks=${remoteBlocks.get} fetch_wait_ms=${fetchWaitMs.get} records_read=${recordsRead.get} " +
      s"map_task_ms=${mapRunMs.get} map_cpu_ms=${mapCpuMs.get} reduce_task_ms=${reduceRunMs.get} " +
      s"reduce_cpu_ms=${reduceCpuMs.get} gc_ms=${gcMs.get}"
}
