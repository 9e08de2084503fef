/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma.jobs

import java.io.File
import java.lang.management.ManagementFactory
import java.lang.ref.WeakReference
import java.nio.file.{Files, Paths}
import javax.management.ObjectName

import scala.collection.mutable
import scala.jdk.CollectionConverters._

import org.apache.spark.{HashPartitioner, ShuffleDependency, SparkContext, SparkEnv}
import org.apache.spark.rdd.RDD
import org.apache.spark.sql.SparkSession

/**
 * Many small shuffles in one application, for leak hunting (scripts/soak.sh). It knows nothing
 * of the plugin and does only what a user can do.
 *
 * Shuffle `i` (1-based) is a `reduceByKey` of 4 map x 4 reduce partitions over 2 000 (key, long)
 * records; every 4th one is instead a `partitionBy` of 4 x 200 records of 2 KiB random values
 * (blocks of ~100 KiB, above the default eagerThreshold, so the pulled path runs too). Each
 * output is compared with the same records computed in the driver without Spark; a mismatch
 * fails the application naming the shuffle and key.
 *
 * The job keeps no reference to a shuffle after its check (only a `WeakReference` to its
 * `ShuffleDependency`), so Spark's ContextCleaner unregisters it once the driver's garbage
 * collector has collected it. Every `every` shuffles (and before the first) it
 *  1. runs `System.gc()` in the driver, as a user of a long application would (or
 *     `spark.cleaner.periodicGC.interval` would, every 30 min by default);
 *  2. samples every executor JVM in a task (after a `System.gc()` there, so heap garbage does
 *     not count), again every 100 ms until every executor's `<source>.shuffles_registered`
 *     gauge (if the metrics source exists) is at most the number of shuffle dependencies still
 *     alive, for at most `cleanup wait s` (the cleaner works asynchronously); the harness
 *     checks the last sample. A sample has: open fds (`/proc/self/fd`), memory maps (`/proc/self/maps` lines), threads
 *     (`/proc/self/task`), `VmRSS` and the part of it outside the Java heap's address range
 *     (after glibc's free memory was trimmed; before, too, as `*_untrimmed_kb`),
 *     the heap in use (after that GC), the JVM's native memory by category when it runs with
 *     `-XX:NativeMemoryTracking=summary` (`nmt.<category>_kb`), and every gauge of the metrics
 *     source
 *     `<source>` read through JMX (`spark.metrics.conf.executor.sink.jmx.class` must be
 *     `org.apache.spark.metrics.sink.JmxSink`; without it no gauges are reported).
 *
 * Output:
 * {{{
 *   SOAK_SAMPLE shuffle=<i> executor=<id> pid=.. fds=.. maps=.. threads=.. rss_kb=.. heap_rss_kb=.. non_heap_rss_kb=.. non_heap_rss_untrimmed_kb=.. native_trimmed=0|1 heap_used_kb=.. live_shuffles=.. cleanup_wait_ms=.. nmt.<category>_kb=.. gauge.<key>=..
 *   SOAK_THREADS shuffle=<i> executor=<id> <thread name with digits as #>=<count> ...
 *   SOAK_DONE shuffles=<n> checked=<n> wall_ms=.. checkpoints=..
 * }}}
 *
 * Usage: SoakJob <shuffles> [every (default 20)] [cleanup wait s (default 30)]
 *        [metrics source (default rdmaShuffle)] [executors (default 2)]
 */
object SoakJob {

  private val Maps = 4
  private val Reduces = 4
  private val SmallRecordsPerMap = 500
  private val LargeRecordsPerMap = 200
  private val LargeValueBytes = 2048

  /** Set once a checkpoint's wait for the cleaner ran out. */
  private var cleanupTimedOut = false

  def main(args: Array[String]): Unit = {
    require(
      args.nonEmpty,
      "usage: SoakJob <shuffles> [every] [cleanup wait s] [source] [executors]")
    val shuffles = args(0).toInt
    val every = if (args.length > 1) args(1).toInt else 20
    val cleanupWaitMs = (if (args.length > 2) args(2).toLong else 30L) * 1000
    val source = if (args.length > 3) args(3) else "rdmaShuffle"
    val executors = if (args.length > 4) args(4).toInt else 2
    require(shuffles > 0 && every > 0, s"shuffles ($shuffles) and every ($every) must be > 0")

    val spark = SparkSession.builder().appName(s"rdma-shuffle-soak-$shuffles").getOrCreate()
    val sc = spark.sparkContext
    waitForExecutors(sc, executors, 180000)
    val deps = mutable.ArrayBuffer[WeakReference[AnyRef]]()
    val start = System.nanoTime()
    var checkpoints = 0
    checkpoint(sc, 0, deps, cleanupWaitMs, source, executors)
    checkpoints += 1
    (1 to shuffles).foreach { i =>
      deps += new WeakReference[AnyRef](runAndCheck(sc, i))
      if (i % every == 0 || i == shuffles) {
        checkpoint(sc, i, deps, cleanupWaitMs, source, executors)
        checkpoints += 1
      }
    }
    val wallMs = (System.nanoTime() - start) / 1000000
    println(
      s"SOAK_DONE shuffles=$shuffles checked=$shuffles wall_ms=$wallMs checkpoints=$checkpoints")
    spark.stop()
  }

  /** Runs shuffle `i`, checks its output, and returns its dependency (for a weak reference). */
  private def runAndCheck(sc: SparkContext, i: Int): AnyRef =
    if (i % 4 == 0) large(sc, i) else small(sc, i)

  private def smallRecords(i: Int, p: Int): Iterator[(Int, Long)] =
    Iterator.range(0, SmallRecordsPerMap).map { j =>
      val n = p * SmallRecordsPerMap + j
      ((n * 7 + i) % 97, (n + i).toLong)
    }

  private def small(sc: SparkContext, i: Int): AnyRef = {
    val rdd = sc.parallelize(0 until Maps, Maps).flatMap(p => smallRecords(i, p))
      .reduceByKey(_ + _, Reduces)
    val got = rdd.collect().toMap
    val want = (0 until Maps).flatMap(p => smallRecords(i, p)).groupBy(_._1)
      .map { case (k, kvs) => k -> kvs.map(_._2).sum }
    if (got != want) {
      val bad = (got.keySet ++ want.keySet).toSeq.sorted.find(k => got.get(k) != want.get(k))
      throw new IllegalStateException(s"soak shuffle $i (reduceByKey): key ${bad.orNull} is " +
        s"${bad.flatMap(got.get)} but must be ${bad.flatMap(want.get)} (${got.size} keys, " +
        s"${want.size} expected)")
    }
    rdd.dependencies.head
  }

  private def largeRecords(i: Int, p: Int): Iterator[(Int, Array[Byte])] = {
    val rnd = new java.util.Random(0x50a4L * i + p)
    Iterator.range(0, LargeRecordsPerMap).map { j =>
      val v = new Array[Byte](LargeValueBytes)
      rnd.nextBytes(v)
      (p * LargeRecordsPerMap + j, v)
    }
  }

  private def large(sc: SparkContext, i: Int): AnyRef = {
    val rdd = sc.parallelize(0 until Maps, Maps).flatMap(p => largeRecords(i, p))
      .partitionBy(new HashPartitioner(Reduces))
    // Per reduce partition: (partition, records, sum of record hashes); each record must be in
    // the partition the partitioner assigns.
    val got = rdd.mapPartitionsWithIndex { (part, it) =>
      var n = 0L
      var s = 0L
      it.foreach { case (k, v) =>
        require(k % Reduces == part, s"key $k in partition $part")
        n += 1
        s += k * 31L + ShuffleJobs.hash64(v)
      }
      Iterator.single((part, (n, s)))
    }.collect().toMap
    val want = (0 until Maps).flatMap(p => largeRecords(i, p)).groupBy(_._1 % Reduces).map {
      case (part, kvs) =>
        part -> ((kvs.size.toLong, kvs.map { case (k, v) => k * 31L + ShuffleJobs.hash64(v) }.sum))
    }
    if (got != want) {
      throw new IllegalStateException(s"soak shuffle $i (partitionBy, 2 KiB values): per " +
        s"partition (records, hash sum) $got but must be $want")
    }
    rdd.dependencies.head
  }

  /** GC in the driver, wait for the cleaner to reach the executors, then sample them. */
  private def checkpoint(
      sc: SparkContext,
      shuffle: Int,
      deps: mutable.ArrayBuffer[WeakReference[AnyRef]],
      cleanupWaitMs: Long,
      source: String,
      executors: Int): Unit = {
    val t0 = System.nanoTime()
    System.gc()
    prune(deps)
    // After one wait ran out, the engines are not catching up (a leak the harness reports):
    // later checkpoints wait 2 s only, so a leaking run fails in minutes, not hours.
    val deadline = System.currentTimeMillis() +
      (if (cleanupTimedOut) math.min(cleanupWaitMs, 2000L) else cleanupWaitMs)
    var lastGc = System.currentTimeMillis()
    def registered(s: Sample): Long = s.gauges.getOrElse("shuffles_registered", 0L)
    // The cleaner works asynchronously (its thread, then messages to the executors): sample
    // until the engines caught up, or the wait is over (then the sample shows what is held).
    var samples = probe(sc, executors, gc = true, source)
    while (samples.exists(s => registered(s) > deps.size) &&
      System.currentTimeMillis() < deadline) {
      Thread.sleep(100)
      if (System.currentTimeMillis() - lastGc > 1000) {
        System.gc()
        lastGc = System.currentTimeMillis()
      }
      prune(deps)
      samples = probe(sc, executors, gc = true, source)
    }
    val waitMs = (System.nanoTime() - t0) / 1000000
    if (samples.exists(s => registered(s) > deps.size)) cleanupTimedOut = true
    samples.sortBy(_.executor).foreach { s =>
      val gauges = (s.nmtKb.toSeq.sorted.map { case (k, v) => s"nmt.${k}_kb=$v" } ++
        s.gauges.toSeq.sorted.map { case (k, v) => s"gauge.$k=$v" }).mkString(" ")
      println(s"SOAK_SAMPLE shuffle=$shuffle executor=${s.executor} pid=${s.pid} fds=${s.fds} " +
        s"maps=${s.maps} threads=${s.threads} rss_kb=${s.rssKb} rss_file_kb=${s.rssFileKb} " +
        s"heap_rss_kb=${s.heapRssKb} " +
        s"non_heap_rss_kb=${s.outsideHeapKb(s.rssKb)} " +
        s"non_heap_rss_untrimmed_kb=${s.outsideHeapKb(s.untrimmedRssKb)} " +
        s"native_trimmed=${if (s.nativeTrimmed) 1 else 0} " +
        s"heap_used_kb=${s.heapUsedKb} " +
        s"live_shuffles=${deps.size} cleanup_wait_ms=$waitMs $gauges")
      println(s"SOAK_THREADS shuffle=$shuffle executor=${s.executor} " +
        s.threadGroups.toSeq.sorted.map { case (k, v) => s"$k=$v" }.mkString(" "))
    }
    System.out.flush()
  }

  /** Drops the weak references whose dependency was collected. */
  private def prune(deps: mutable.ArrayBuffer[WeakReference[AnyRef]]): Unit = {
    val alive = deps.filter(_.get != null)
    deps.clear()
    deps ++= alive
  }

  /** One sample of each executor, from tasks spread over them (retried until all answered). */
  private def probe(sc: SparkContext, executors: Int, gc: Boolean, source: String): Seq[Sample] = {
    val seen = mutable.LinkedHashMap[String, Sample]()
    var attempts = 0
    while (seen.size < executors) {
      attempts += 1
      require(
        attempts <= 20,
        s"sampling reached only executors ${seen.keys.mkString(",")} " +
          s"of $executors in 20 jobs")
      val n = executors * 2
      sc.parallelize(0 until n, n).mapPartitions { _ =>
        // Long enough that every executor (1 core each on local-cluster) gets a task.
        Thread.sleep(50)
        Iterator.single(Sample.take(gc, source))
      }.collect().foreach(s => seen.getOrElseUpdate(s.executor, s))
    }
    seen.values.toSeq
  }

  private def waitForExecutors(sc: SparkContext, n: Int, timeoutMs: Long): Unit = {
    val deadline = System.currentTimeMillis() + timeoutMs
    while (sc.statusTracker.getExecutorInfos.length < n + 1) { // the driver is one of them
      require(System.currentTimeMillis() < deadline, s"fewer than $n executors registered")
      Thread.sleep(200)
    }
  }
}

/** What one executor JVM holds at one moment (taken inside a task). */
final case class Sample(
    executor: String,
    pid: Long,
    fds: Int,
    maps: Int,
    threads: Int,
    rssKb: Long,
    rssFileKb: Long,
    untrimmedRssKb: Long,
    nativeTrimmed: Boolean,
    heapRssKb: Long,
    heapUsedKb: Long,
    threadGroups: Map[String, Int],
    nmtKb: Map[String, Long],
    gauges: Map[String, Long]) {

  /** The part of resident kB `rss` outside the Java heap's address range; -1 if unknown. */
  def outsideHeapKb(rss: Long): Long = if (heapRssKb >= 0) rss - heapRssKb else -1
}

object Sample {

  /** Samples this JVM; `gc` collects its heap garbage first. Gauges: `<source>.*` over JMX. */
  def take(gc: Boolean, source: String): Sample = {
    if (gc) System.gc()
    val rt = Runtime.getRuntime
    val tasks = Option(new File("/proc/self/task").listFiles()).getOrElse(Array.empty[File])
    val groups = tasks.toSeq.flatMap { t =>
      try Some(new String(
          Files.readAllBytes(t.toPath.resolve("comm")),
          "UTF-8").trim.replaceAll("[0-9]+", "#")
          .replaceAll("[^A-Za-z#_.-]", "_"))
      catch { case _: java.io.IOException => None } // the thread ended meanwhile
    }.groupBy(identity).map { case (k, v) => k -> v.size }
    val untrimmed = statusKb("VmRSS")
    // The native heap's garbage goes too, as the Java heap's did: glibc keeps memory freed by
    // any thread (C2's arenas, the engine's frames) in its arenas until trimmed, so RSS then
    // says how much memory is free in malloc, not what the process holds. Both are reported.
    val trimmed = gc && trimNativeHeap()
    val rss = statusKb("VmRSS")
    val rssFile = statusKb("RssFile")
    val heapRss = heapResidentKb()
    Sample(
      executor = SparkEnv.get.executorId,
      pid = new File("/proc/self").getCanonicalFile.getName.toLong, // Java 8 has no ProcessHandle
      fds = Option(new File("/proc/self/fd").list()).map(_.length).getOrElse(-1),
      maps = Files.readAllLines(Paths.get("/proc/self/maps")).size,
      threads = tasks.length,
      rssKb = rss,
      rssFileKb = rssFile,
      untrimmedRssKb = untrimmed,
      nativeTrimmed = trimmed,
      heapRssKb = heapRss,
      heapUsedKb = (rt.totalMemory() - rt.freeMemory()) / 1024,
      threadGroups = groups,
      nmtKb = nativeMemoryKb(),
      gauges = gauges(source)
    )
  }

  /** A kB field of `/proc/self/status` (`VmRSS`, `RssFile`: Linux 4.5+); -1 if absent. */
  private def statusKb(field: String): Long =
    Files.readAllLines(Paths.get("/proc/self/status")).asScala
      .find(_.startsWith(field + ":")).map(_.split("\\s+")(1).toLong).getOrElse(-1L)

  /**
   * Runs one of HotSpot's diagnostic commands (what `jcmd` runs; `op` in the MBean's spelling,
   * e.g. `gcHeapInfo` for `GC.heap_info`) and returns its output. Throws where the JVM has no
   * such command.
   */
  private def diagnosticCommand(op: String, args: String*): String =
    ManagementFactory.getPlatformMBeanServer.invoke(
      new ObjectName("com.sun.management:type=DiagnosticCommand"),
      op,
      Array[AnyRef](args.toArray),
      Array(classOf[Array[String]].getName)).toString

  /**
   * Returns glibc's free memory to the kernel (`malloc_trim`, through HotSpot's
   * `System.trim_native_heap` diagnostic command, JDK 17.0.9+); false where the JVM has no
   * such command.
   */
  private def trimNativeHeap(): Boolean = {
    try {
      val out = diagnosticCommand("systemTrimNativeHeap")
      !out.toLowerCase.contains("not available")
    } catch { case _: Exception => false }
  }

  /**
   * Resident kB of the Java heap's address range: how much of VmRSS is heap pages the
   * collector touched (it varies by 100+ MB with where the young generation was when the
   * sample was taken), so `rss - heap` is the memory that only a leak makes grow: native
   * allocations (the engine's), metaspace, code, thread stacks. The range comes from HotSpot's
   * `GC.heap_info` diagnostic command (`[0x..., 0x...)`), the pages from `/proc/self/smaps`.
   * -1 when either is unavailable.
   */
  private def heapResidentKb(): Long = {
    try {
      val info = diagnosticCommand("gcHeapInfo")
      val range = """\[0x([0-9a-f]+), 0x([0-9a-f]+)\)""".r
      val (lo, hi) = range.findFirstMatchIn(info) match {
        case Some(m) => (
            java.lang.Long.parseUnsignedLong(m.group(1), 16),
            java.lang.Long.parseUnsignedLong(m.group(2), 16))
        case None => return -1L
      }
      val header = """^([0-9a-f]+)-([0-9a-f]+) .*""".r
      var inHeap = false
      var kb = 0L
      Files.readAllLines(Paths.get("/proc/self/smaps")).asScala.foreach {
        case header(a, b) =>
          inHeap = java.lang.Long.parseUnsignedLong(a, 16) >= lo &&
            java.lang.Long.parseUnsignedLong(b, 16) <= hi
        case l if inHeap && l.startsWith("Rss:") => kb += l.split("\\s+")(1).toLong
        case _ =>
      }
      kb
    } catch { case _: Exception => -1L }
  }

  /**
   * The JVM's own native memory by category, committed kB (`total`, `java_heap`, `code`,
   * `class`, `thread`, `gc`, `compiler`, ...), from HotSpot's `VM.native_memory summary`
   * diagnostic command; empty unless the JVM runs with `-XX:NativeMemoryTracking=summary`.
   * Memory the JVM does not allocate itself (the engine's, in its Rust library) is not in it,
   * so RSS minus this says how much is outside the JVM.
   */
  private def nativeMemoryKb(): Map[String, Long] = {
    try {
      val text = diagnosticCommand("vmNativeMemory", "summary")
      val total = """(?m)^Total: reserved=\d+KB, committed=(\d+)KB""".r
      val category = """(?m)^-\s+(.+?) \(reserved=\d+KB, committed=(\d+)KB\)""".r
      total.findFirstMatchIn(text).map(m => "total" -> m.group(1).toLong).toMap ++
        category.findAllMatchIn(text).map { m =>
          m.group(1).trim.toLowerCase.replaceAll("[^a-z0-9]+", "_") -> m.group(2).toLong
        }
    } catch { case _: Exception => Map.empty }
  }

  /** Every gauge `<anything>.<source>.<key>` of JMX domain `metrics` (Spark's JmxSink). */
  private def gauges(source: String): Map[String, Long] = {
    val server = ManagementFactory.getPlatformMBeanServer
    val marker = s".$source."
    server.queryNames(new ObjectName("metrics:*"), null).asScala.toSeq.flatMap { name =>
      val n = Option(name.getKeyProperty("name")).getOrElse("")
      val at = n.indexOf(marker)
      if (at < 0) None
      else {
        try {
          server.getAttribute(name, "Value") match {
            case v: java.lang.Number => Some(n.substring(at + marker.length) -> v.longValue())
            case _ => None
          }
        } catch { case _: Exception => None } // unregistered meanwhile
      }
    }.toMap
  }
}
