/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma.jobs

import java.io.File
import java.nio.file.{FileAlreadyExistsException, Files}
import java.util.concurrent.ConcurrentHashMap
import java.util.concurrent.atomic.AtomicInteger

import scala.jdk.CollectionConverters._
import scala.reflect.ClassTag

import org.apache.spark.{
  HashPartitioner,
  Partition,
  ShuffleDependency,
  SparkContext,
  SparkEnv,
  TaskContext
}
import org.apache.spark.rdd.RDD
import org.apache.spark.scheduler.{
  SparkListener,
  SparkListenerStageCompleted,
  SparkListenerStageSubmitted,
  SparkListenerTaskEnd
}
import org.apache.spark.sql.SparkSession

/**
 * A self-checking shuffle job with gates between its map and reduce stages, so that a test
 * (tests/spark/test_faults.py) can kill an executor at a chosen point and check that Spark
 * recovers. Like [[ShuffleJobs]] it knows nothing of the plugin.
 *
 * Usage: `FaultJob <gateDir> <scenario[,scenario...]> [executors]`. Each scenario runs one job:
 * 8 map tasks generate seeded records (an Int key and a 4 KiB random payload, 24 MiB in all),
 * `partitionBy` sends them to 4 reduce tasks, and each reduce task digests what it received. The
 * driver computes the expected digest from the same generator without any shuffle, so the job
 * knows its own correct result. Each job first waits for `executors` live executors (default 2;
 * a killed one is replaced by its worker). Scenarios:
 *  - `clean`: no gate;
 *  - `before_reduce`: each reduce task creates `<gateDir>/waiting-before_reduce-exec<id>-...`
 *    and waits for `<gateDir>/go-before_reduce` before it asks for its shuffle input (so an
 *    executor killed meanwhile leaves its map outputs missing, and the reducers fail with a
 *    metadata fetch failure; or a map output's files damaged meanwhile are read by them);
 *  - `during_reduce`: each reduce task reads its first record (the reader has the map output
 *    locations and has started fetching), creates
 *    `<gateDir>/reading-during_reduce-exec<id>-part<p>-attempt<n>`, then waits for
 *    `<gateDir>/go-during_reduce` (so its remaining fetches go to an executor killed meanwhile,
 *    and fail as real fetch failures);
 *  - `slow_reduce`: a slow consumer, no gate: 16 maps of 1000 records of 16 KiB (250 MiB) go
 *    to 2 reduce tasks, each sleeping `spark.faultJob.sleepPerRecordMs` (default 5) per record, so
 *    a reducer holds fetched blocks far longer than it takes to fetch them.
 * A scenario may carry a suffix after a dot (`during_reduce.3`): the same kind, its own gates
 * and job group, so one application can repeat a fault. The gates give up after 5 minutes so a
 * harness that died cannot leave tasks hanging forever.
 *
 * Lines printed (stdout, one per event, grepped by the test):
 * {{{
 *   FAULT_APP id=<app id>
 *   FAULT_START scenario=<s> start_ms=<epoch ms>
 *   FAULT_MAP_DONE scenario=<s> shuffle=<id> stage=<id> attempt=<n> outputs=<exec>:<n>,...
 *                  hosts=<exec>:<host>,...
 *   FAULT_RESULT scenario=<s> shuffle=<id> records=<n> sum=<hex> expected_records=<n>
 *                expected_sum=<hex> misplaced=<n> ok=<bool> start_ms=<epoch ms> end_ms=<epoch ms>
 * }}}
 * `outputs` counts the successful map tasks of that stage attempt per executor, `hosts` names
 * each such executor's host. The job exits with an exception if any result is wrong.
 *
 * To make a reduce task fetch remote blocks one by one (so that some are still to be fetched
 * when the gate opens), run it with `spark.reducer.maxSizeInFlight` below the 750 KiB block size.
 */
object FaultJob {

  /** Scenario kinds. */
  val Scenarios: Seq[String] = Seq("clean", "before_reduce", "during_reduce", "slow_reduce")

  /** The kind of a scenario name (`during_reduce.3` -> `during_reduce`). */
  def kindOf(scenario: String): String = scenario.takeWhile(_ != '.')

  /** Shape of one scenario's job: map tasks, records per map, payload bytes, reduce tasks. */
  final case class Shape(maps: Int, recordsPerMap: Int, payloadBytes: Int, reduces: Int)

  /**
   * The shape of a scenario kind: the slow consumer's is ten times larger, in blocks of about
   * 8 MiB (within the engine's default largest pool tier).
   */
  def shapeOf(kind: String): Shape =
    if (kind == "slow_reduce") Shape(16, 1000, 16384, 2)
    else Shape(MapTasks, RecordsPerMap, PayloadBytes, ReduceTasks)

  val MapTasks = 8
  val ReduceTasks = 4
  val RecordsPerMap = 750
  val PayloadBytes = 4096

  /** How long a gate waits for its go file before failing the task. */
  val GateTimeoutMs: Long = 5 * 60 * 1000L

  /** How long a scenario waits for two live executors (a killed one is replaced by its worker). */
  val ExecutorWaitMs: Long = 3 * 60 * 1000L

  def main(args: Array[String]): Unit = {
    require(
      args.length == 2 || args.length == 3,
      s"usage: FaultJob <gateDir> <scenario[,scenario...]> [executors]; scenarios: " +
        Scenarios.mkString(", "))
    val gateDir = args(0)
    val scenarios = args(1).split(",").map(_.trim).toSeq
    val executors = if (args.length == 3) args(2).toInt else 2
    scenarios.foreach(s =>
      require(
        Scenarios.contains(kindOf(s)),
        s"unknown scenario '$s'; scenarios: ${Scenarios.mkString(", ")} (optionally .<suffix>)"))
    require(scenarios.distinct.size == scenarios.size, s"scenario named twice: ${args(1)}")
    require(new File(gateDir).isDirectory, s"gate directory $gateDir does not exist")

    val spark = SparkSession.builder().appName(s"rdma-shuffle-faults-${scenarios.mkString("+")}")
      .getOrCreate()
    val wrong = run(spark.sparkContext, gateDir, scenarios, executors)
    spark.stop()
    if (wrong.nonEmpty)
      throw new IllegalStateException(s"wrong results in scenarios: ${wrong.mkString(", ")}")
  }

  /**
   * Runs one job per scenario in `sc`'s application (see the object's doc) and returns the
   * scenarios whose result was wrong. Before each job the driver waits for `executors` live
   * executors. Under dynamic allocation, where executors come only for tasks waiting, pass
   * `executors = 0` and `mapsAwaitPeers = n`: the job's map tasks then wait, inside the tasks,
   * until the driver knows `n` executors besides theirs, so that the job runs on `n + 1`.
   */
  def run(
      sc: SparkContext,
      gateDir: String,
      scenarios: Seq[String],
      executors: Int,
      mapsAwaitPeers: Int = 0): Seq[String] = {
    say(s"FAULT_APP id=${sc.applicationId}")
    val mapStages = new MapStageListener
    sc.addSparkListener(mapStages)

    val sleepMs = sc.getConf.getLong("spark.faultJob.sleepPerRecordMs", 5L)
    val results = scenarios.zipWithIndex.map { case (scenario, i) =>
      awaitExecutors(sc, executors)
      val shape = shapeOf(kindOf(scenario))
      val startMs = System.currentTimeMillis()
      say(s"FAULT_START scenario=$scenario start_ms=$startMs")
      sc.setJobGroup(scenario, s"fault scenario $scenario")
      val seed = 7000L + 100L * i
      val splits = sc.parallelize(0 until shape.maps, shape.maps)
      val held =
        if (mapsAwaitPeers == 0) splits
        else splits.mapPartitions { it => ElasticJob.awaitPeers(mapsAwaitPeers); it }
      val data = held.flatMap(p => records(seed, p, shape))
      val reduces = shape.reduces
      val shuffled = data.partitionBy(new HashPartitioner(reduces))
      val shuffleId = shuffled.dependencies.head.asInstanceOf[ShuffleDependency[_, _, _]].shuffleId
      mapStages.expect(shuffleId, scenario)
      val gated = new GateRDD(shuffled, gateDir, scenario, sleepMs)
      val perPartition = digestPartitions(gated, reduces)
      sc.clearJobGroup()
      val endMs = System.currentTimeMillis()
      val (expN, expSum) = expected(seed, shape)
      val n = perPartition.map(_._1).sum
      val sum = perPartition.map(_._2).sum
      val misplaced = perPartition.map(_._3).sum
      val ok = n == expN && sum == expSum && misplaced == 0
      say(f"FAULT_RESULT scenario=$scenario shuffle=$shuffleId records=$n sum=$sum%016x " +
        f"expected_records=$expN expected_sum=$expSum%016x misplaced=$misplaced ok=$ok " +
        f"start_ms=$startMs end_ms=$endMs")
      (scenario, ok)
    }
    sc.removeSparkListener(mapStages)
    results.filterNot(_._2).map(_._1)
  }

  /** Prints a line at once: the harness acts on these while the job runs. */
  private[jobs] def say(line: String): Unit = {
    println(line)
    Console.out.flush()
  }

  /** The records of map task `p`: deterministic, so a recomputed map task writes the same. */
  def records(seed: Long, p: Int, shape: Shape): Iterator[(Int, Array[Byte])] = {
    val rnd = new java.util.Random(seed * 1000003L + p)
    Iterator.fill(shape.recordsPerMap) {
      val payload = new Array[Byte](shape.payloadBytes)
      rnd.nextBytes(payload)
      (rnd.nextInt(), payload)
    }
  }

  /**
   * Per reduce partition of `rdd` (hash-partitioned into `reduces`): records, the sum of their
   * [[recordHash]]es, and records in the wrong partition.
   */
  private[jobs] def digestPartitions(
      rdd: RDD[(Int, Array[Byte])],
      reduces: Int): Array[(Long, Long, Long)] =
    rdd.mapPartitionsWithIndex { (p, it) =>
      val partitioner = new HashPartitioner(reduces)
      var n = 0L
      var sum = 0L
      var misplaced = 0L
      it.foreach { case (k, v) =>
        n += 1
        sum += recordHash(k, v)
        if (partitioner.getPartition(k) != p) misplaced += 1
      }
      Iterator.single((n, sum, misplaced))
    }.collect()

  def recordHash(k: Int, v: Array[Byte]): Long =
    ShuffleJobs.hash64(v) * 31 + k.toLong * 0x9e3779b97f4a7c15L

  /**
   * The digest the job must produce, computed on the driver without a shuffle; `rekey` is what
   * the job did to each key before its last shuffle (ElasticJob re-keys, FaultJob does not).
   */
  def expected(seed: Long, shape: Shape, rekey: Int => Int = identity): (Long, Long) = {
    var n = 0L
    var sum = 0L
    for (p <- 0 until shape.maps; (k, v) <- records(seed, p, shape)) {
      n += 1
      sum += recordHash(rekey(k), v)
    }
    (n, sum)
  }

  private[jobs] def awaitExecutors(sc: SparkContext, n: Int): Unit = {
    val deadline = System.currentTimeMillis() + ExecutorWaitMs
    // getExecutorInfos includes the driver.
    while (sc.statusTracker.getExecutorInfos.length - 1 < n) {
      if (System.currentTimeMillis() > deadline) {
        throw new IllegalStateException(
          s"fewer than $n executors after ${ExecutorWaitMs / 1000} s: " +
            sc.statusTracker.getExecutorInfos.map(e => s"${e.host}:${e.port}").mkString(", "))
      }
      Thread.sleep(200)
    }
  }

  /**
   * Prints `FAULT_MAP_DONE` when a map stage of an expected shuffle completes. A stage is matched
   * to its shuffle by the job group (scenario) of the job that ran it.
   */
  private final class MapStageListener extends SparkListener {
    private val shuffleOfScenario = new ConcurrentHashMap[String, Integer]()
    private val scenarioOfStage = new ConcurrentHashMap[Integer, String]()
    // (stageId, attempt) -> executor -> successful map tasks
    private val outputs =
      new ConcurrentHashMap[(Int, Int), ConcurrentHashMap[String, AtomicInteger]]()
    private val hostOf = new ConcurrentHashMap[String, String]()

    def expect(shuffleId: Int, scenario: String): Unit = shuffleOfScenario.put(scenario, shuffleId)

    override def onStageSubmitted(submitted: SparkListenerStageSubmitted): Unit = {
      Option(submitted.properties).flatMap(p => Option(p.getProperty("spark.jobGroup.id")))
        .foreach(s => scenarioOfStage.put(submitted.stageInfo.stageId, s))
    }

    override def onTaskEnd(end: SparkListenerTaskEnd): Unit = {
      if (end.taskType == "ShuffleMapTask" && end.reason == org.apache.spark.Success) {
        hostOf.put(end.taskInfo.executorId, end.taskInfo.host)
        outputs.computeIfAbsent((end.stageId, end.stageAttemptId), _ => new ConcurrentHashMap())
          .computeIfAbsent(end.taskInfo.executorId, _ => new AtomicInteger()).incrementAndGet()
      }
    }

    override def onStageCompleted(done: SparkListenerStageCompleted): Unit = {
      val info = done.stageInfo
      val counts = outputs.get((info.stageId, info.attemptNumber()))
      val scenario = Option(scenarioOfStage.get(info.stageId))
      if (counts != null && info.failureReason.isEmpty) {
        val shuffle =
          scenario.flatMap(s => Option(shuffleOfScenario.get(s))).map(_.toString).getOrElse("?")
        val rendered = counts.asScala.toSeq.sortBy(_._1).map { case (e, c) =>
          s"$e:${c.get}"
        }.mkString(",")
        val hosts = counts.asScala.keys.toSeq.sorted.map(e => s"$e:${hostOf.get(e)}").mkString(",")
        say(s"FAULT_MAP_DONE scenario=${scenario.getOrElse("?")} shuffle=$shuffle " +
          s"stage=${info.stageId} attempt=${info.attemptNumber()} outputs=$rendered hosts=$hosts")
      }
    }
  }
}

/**
 * Passes its parent's partitions through, holding each task at the scenario's gate (see
 * [[FaultJob]]). Runs inside reduce tasks, on executors.
 */
private final class GateRDD[T: ClassTag](
    @transient prev: RDD[T],
    gateDir: String,
    scenario: String,
    sleepPerRecordMs: Long)
  extends RDD[T](prev) {

  override protected def getPartitions: Array[Partition] = firstParent[T].partitions

  override def compute(split: Partition, context: TaskContext): Iterator[T] =
    FaultJob.kindOf(scenario) match {
      case "before_reduce" =>
        mark("waiting", split, context)
        awaitGo()
        firstParent[T].iterator(split, context)
      case "during_reduce" =>
        val it = firstParent[T].iterator(split, context).buffered
        it.hasNext // the first block has arrived: the reader holds the map output locations
        mark("reading", split, context)
        awaitGo()
        it
      case "slow_reduce" =>
        firstParent[T].iterator(split, context).map { r =>
          Thread.sleep(sleepPerRecordMs)
          r
        }
      case _ =>
        firstParent[T].iterator(split, context)
    }

  /** `<gateDir>/<what>-<scenario>-exec<id>-part<p>-attempt<n>`: where the task has got to. */
  private def mark(what: String, split: Partition, context: TaskContext): Unit = {
    val marker = new File(
      gateDir,
      s"$what-$scenario-exec${SparkEnv.get.executorId}-" +
        s"part${split.index}-attempt${context.stageAttemptNumber()}")
    try Files.createFile(marker.toPath)
    catch { case _: FileAlreadyExistsException => }
  }

  private def awaitGo(): Unit = {
    val go = new File(gateDir, s"go-$scenario")
    val deadline = System.currentTimeMillis() + FaultJob.GateTimeoutMs
    while (!go.exists()) {
      if (System.currentTimeMillis() > deadline) {
        throw new IllegalStateException(
          s"gate $go not opened within ${FaultJob.GateTimeoutMs / 1000} s")
      }
      Thread.sleep(100)
    }
  }
}
