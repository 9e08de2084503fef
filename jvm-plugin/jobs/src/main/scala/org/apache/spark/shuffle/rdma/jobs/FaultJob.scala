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
 * Usage: `FaultJob <gateDir> <scenario[,scenario...]>`. Each scenario runs one job: 8 map tasks
 * generate seeded records (an Int key and a 4 KiB random payload, 24 MiB in all), `partitionBy`
 * sends them to 4 reduce tasks, and each reduce task digests what it received. The driver
 * computes the expected digest from the same generator without any shuffle, so the job knows
 * its own correct result. Scenarios:
 *  - `clean`: no gate;
 *  - `before_reduce`: each reduce task waits for `<gateDir>/go-before_reduce` before it asks for
 *    its shuffle input (so an executor killed meanwhile leaves its map outputs missing, and the
 *    reducers fail with a metadata fetch failure);
 *  - `during_reduce`: each reduce task reads its first record (the reader has the map output
 *    locations and has started fetching), creates
 *    `<gateDir>/reading-during_reduce-exec<id>-part<p>-attempt<n>`, then waits for
 *    `<gateDir>/go-during_reduce` (so its remaining fetches go to an executor killed meanwhile,
 *    and fail as real fetch failures).
 * The gates give up after 5 minutes so a harness that died cannot leave tasks hanging forever.
 *
 * Lines printed (stdout, one per event, grepped by the test):
 * {{{
 *   FAULT_APP id=<app id>
 *   FAULT_MAP_DONE scenario=<s> shuffle=<id> stage=<id> attempt=<n> outputs=<exec>:<n>,...
 *   FAULT_RESULT scenario=<s> shuffle=<id> records=<n> sum=<hex> expected_records=<n>
 *                expected_sum=<hex> misplaced=<n> ok=<bool>
 * }}}
 * `outputs` counts the successful map tasks of that stage attempt per executor. The job exits
 * with an exception if any result is wrong.
 *
 * To make a reduce task fetch remote blocks one by one (so that some are still to be fetched
 * when the gate opens), run it with `spark.reducer.maxSizeInFlight` below the 750 KiB block size.
 */
object FaultJob {

  /** Scenario names, in the order the test uses them. */
  val Scenarios: Seq[String] = Seq("clean", "before_reduce", "during_reduce")

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
      args.length == 2,
      s"usage: FaultJob <gateDir> <scenario[,scenario...]>; scenarios: " +
        Scenarios.mkString(", "))
    val gateDir = args(0)
    val scenarios = args(1).split(",").map(_.trim).toSeq
    scenarios.foreach(s =>
      require(
        Scenarios.contains(s),
        s"unknown scenario '$s'; scenarios: ${Scenarios.mkString(", ")}"))
    require(new File(gateDir).isDirectory, s"gate directory $gateDir does not exist")

    val spark = SparkSession.builder().appName(s"rdma-shuffle-faults-${scenarios.mkString("+")}")
      .getOrCreate()
    val sc = spark.sparkContext
    say(s"FAULT_APP id=${sc.applicationId}")
    val mapStages = new MapStageListener
    sc.addSparkListener(mapStages)

    val results = scenarios.zipWithIndex.map { case (scenario, i) =>
      awaitExecutors(sc, 2)
      sc.setJobGroup(scenario, s"fault scenario $scenario")
      val seed = 7000L + 100L * i
      val data = sc.parallelize(0 until MapTasks, MapTasks)
        .flatMap(p => records(seed, p))
      val shuffled = data.partitionBy(new HashPartitioner(ReduceTasks))
      val shuffleId = shuffled.dependencies.head.asInstanceOf[ShuffleDependency[_, _, _]].shuffleId
      mapStages.expect(shuffleId, scenario)
      val gated = new GateRDD(shuffled, gateDir, scenario)
      val perPartition = gated.mapPartitionsWithIndex { (p, it) =>
        val partitioner = new HashPartitioner(ReduceTasks)
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
      sc.clearJobGroup()
      val (expN, expSum) = expected(seed)
      val n = perPartition.map(_._1).sum
      val sum = perPartition.map(_._2).sum
      val misplaced = perPartition.map(_._3).sum
      val ok = n == expN && sum == expSum && misplaced == 0
      say(f"FAULT_RESULT scenario=$scenario shuffle=$shuffleId records=$n sum=$sum%016x " +
        f"expected_records=$expN expected_sum=$expSum%016x misplaced=$misplaced ok=$ok")
      (scenario, ok)
    }
    spark.stop()
    val wrong = results.filterNot(_._2).map(_._1)
    if (wrong.nonEmpty)
      throw new IllegalStateException(s"wrong results in scenarios: ${wrong.mkString(", ")}")
  }

  /** Prints a line at once: the harness acts on these while the job runs. */
  private def say(line: String): Unit = {
    println(line)
    Console.out.flush()
  }

  /** The records of map task `p`: deterministic, so a recomputed map task writes the same. */
  def records(seed: Long, p: Int): Iterator[(Int, Array[Byte])] = {
    val rnd = new java.util.Random(seed * 1000003L + p)
    Iterator.fill(RecordsPerMap) {
      val payload = new Array[Byte](PayloadBytes)
      rnd.nextBytes(payload)
      (rnd.nextInt(), payload)
    }
  }

  def recordHash(k: Int, v: Array[Byte]): Long =
    ShuffleJobs.hash64(v) * 31 + k.toLong * 0x9e3779b97f4a7c15L

  /** The digest the job must produce, computed on the driver without a shuffle. */
  def expected(seed: Long): (Long, Long) = {
    var n = 0L
    var sum = 0L
    for (p <- 0 until MapTasks; (k, v) <- records(seed, p)) {
      n += 1
      sum += recordHash(k, v)
    }
    (n, sum)
  }

  private def awaitExecutors(sc: SparkContext, n: Int): Unit = {
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

    def expect(shuffleId: Int, scenario: String): Unit = shuffleOfScenario.put(scenario, shuffleId)

    override def onStageSubmitted(submitted: SparkListenerStageSubmitted): Unit = {
      Option(submitted.properties).flatMap(p => Option(p.getProperty("spark.jobGroup.id")))
        .foreach(s => scenarioOfStage.put(submitted.stageInfo.stageId, s))
    }

    override def onTaskEnd(end: SparkListenerTaskEnd): Unit = {
      if (end.taskType == "ShuffleMapTask" && end.reason == org.apache.spark.Success) {
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
        say(s"FAULT_MAP_DONE scenario=${scenario.getOrElse("?")} shuffle=$shuffle " +
          s"stage=${info.stageId} attempt=${info.attemptNumber()} outputs=$rendered")
      }
    }
  }
}

/**
 * Passes its parent's partitions through, holding each task at the scenario's gate (see
 * [[FaultJob]]). Runs inside reduce tasks, on executors.
 */
private final class GateRDD[T: ClassTag](@transient prev: RDD[T], gateDir: String, scenario: String)
  extends RDD[T](prev) {

  override protected def getPartitions: Array[Partition] = firstParent[T].partitions

  override def compute(split: Partition, context: TaskContext): Iterator[T] = scenario match {
    case "before_reduce" =>
      awaitGo()
      firstParent[T].iterator(split, context)
    case "during_reduce" =>
      val it = firstParent[T].iterator(split, context).buffered
      it.hasNext // the first block has arrived: the reader holds the map output locations
      val marker = new File(
        gateDir,
        s"reading-$scenario-exec${SparkEnv.get.executorId}-" +
          s"part${split.index}-attempt${context.stageAttemptNumber()}")
      try Files.createFile(marker.toPath)
      catch { case _: FileAlreadyExistsException => }
      awaitGo()
      it
    case _ =>
      firstParent[T].iterator(split, context)
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
