/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma.jobs

import java.util.concurrent.ConcurrentHashMap
import java.util.concurrent.atomic.AtomicInteger

import scala.jdk.CollectionConverters._

import org.apache.spark.{
  ExecutorAllocationClient,
  HashPartitioner,
  ShuffleDependency,
  SparkContext,
  SparkEnv
}
import org.apache.spark.rdd.RDD
import org.apache.spark.scheduler.{
  ExecutorDecommissionInfo,
  SparkListener,
  SparkListenerExecutorAdded,
  SparkListenerExecutorRemoved,
  SparkListenerTaskEnd
}
import org.apache.spark.shuffle.MetadataFetchFailedException
import org.apache.spark.sql.SparkSession
import org.apache.spark.storage.ShuffleBlockId

/**
 * Executors that leave and join while shuffle data is live: a self-checking job for
 * tests/spark/test_elastic.py. Like [[ShuffleJobs]] and [[FaultJob]] it knows nothing of the
 * plugin, and the driver computes each expected digest without a shuffle.
 *
 * Usage: `ElasticJob decommission|dynamic|service`.
 *
 *  - `decommission` (3 executors, `spark.decommission.enabled`,
 *    `spark.storage.decommission.shuffleBlocks.enabled`): the map stage of a shuffle (12 map
 *    tasks of 500 records of 4 KiB, 6 reduce partitions) runs alone (`submitMapStage`); the
 *    executor holding most of its outputs is decommissioned the way a cluster manager does it
 *    (`ExecutorAllocationClient.decommissionExecutor`); once the driver places none of the
 *    outputs on it (they were migrated to the others), the reduce stage runs. No map task may
 *    run again (`maps_rerun=0`): the reducers read the migrated outputs.
 *  - `dynamic` (dynamic allocation with shuffle tracking, from 1 executor, at most 3): two
 *    rounds of a three-stage job (12 map tasks -> 6 partitions -> re-keyed -> 3 partitions ->
 *    digest). The backlog of the first stage brings executors in during each round (its first
 *    tasks wait until the driver knows 3 executors, at most 3 minutes); between the rounds
 *    both shuffles are cleaned up, so the idle executors hold no shuffle data and are removed,
 *    and the second round runs on executors that did not exist in the first.
 *  - `service` (dynamic allocation beside the external shuffle service,
 *    `spark.shuffle.service.enabled`, from 0 executors, at most 2): the map stages of two
 *    shuffles (12 map tasks -> 6 partitions -> re-keyed -> 3 partitions) run on executors that
 *    joined for them (the first tasks wait until two executors are up), so the first shuffle's
 *    blocks cross executors; then the job waits until dynamic allocation has released every
 *    executor (the service keeps their map outputs), and the last stage runs on new executors,
 *    reading the second shuffle's outputs of executors that are gone. No map task may run again
 *    (`maps_rerun=0`): the outputs were read from the service.
 *
 * Lines printed (stdout):
 * {{{
 *   ELASTIC_APP id=<app id>
 *   ELASTIC_MAP_DONE shuffle=<id> outputs=<exec>:<n>,...
 *   ELASTIC_MIGRATED victim=<exec> outputs=<exec>:<n>,... missing=<n> wait_ms=<n>
 *   ELASTIC_ROUND round=<n> executors=<exec>,... removed_before=<exec>,...
 *   ELASTIC_RELEASED outputs=<exec>:<n>,... removed=<exec>,... wait_ms=<n>
 *   ELASTIC_RESULT mode=<m> round=<n> records=<n> sum=<hex> expected_records=<n>
 *                  expected_sum=<hex> misplaced=<n> maps_rerun=<n> ok=<bool>
 *   ELASTIC_EXECUTORS added=<exec>,... removed=<exec>,...
 * }}}
 * The job exits with an exception if a result is wrong; what the executors did (migrated, left,
 * joined) is for the test to judge from these lines.
 */
object ElasticJob {

  /** How long the job waits for a migration or for idle executors to go. */
  val WaitMs: Long = 3 * 60 * 1000L

  private val DecommissionShape = FaultJob.Shape(12, 500, 4096, 6)
  private val DynamicShape = FaultJob.Shape(12, 250, 4096, 6)

  def main(args: Array[String]): Unit = {
    require(
      args.length == 1 && Set("decommission", "dynamic", "service").contains(args(0)),
      "usage: ElasticJob decommission|dynamic|service")
    val spark = SparkSession.builder().appName(s"rdma-shuffle-elastic-${args(0)}").getOrCreate()
    val ok = run(spark.sparkContext, args(0))
    spark.stop()
    if (!ok)
      throw new IllegalStateException(s"ElasticJob ${args(0)}: wrong result (see ELASTIC_RESULT)")
  }

  /**
   * Runs `mode` in `sc`'s application (see the object's doc) and returns whether its result was
   * right; the lines it prints end with `ELASTIC_EXECUTORS`.
   */
  def run(sc: SparkContext, mode: String): Boolean = {
    FaultJob.say(s"ELASTIC_APP id=${sc.applicationId}")
    val events = new Events
    sc.addSparkListener(events)
    try
      mode match {
        case "decommission" => decommission(sc, events)
        case "dynamic" => dynamic(sc, events)
        case _ => service(sc, events)
      }
    finally {
      sc.removeSparkListener(events)
      FaultJob.say(
        s"ELASTIC_EXECUTORS added=${events.added.asScala.toSeq.sorted.mkString(",")} " +
          s"removed=${events.removed.asScala.toSeq.sorted.mkString(",")}")
    }
  }

  private def decommission(sc: SparkContext, events: Events): Boolean = {
    FaultJob.awaitExecutors(sc, 3)
    val shape = DecommissionShape
    val seed = 9100L
    val shuffled = sc.parallelize(0 until shape.maps, shape.maps)
      .flatMap(p => FaultJob.records(seed, p, shape))
      .partitionBy(new HashPartitioner(shape.reduces))
    val dep =
      shuffled.dependencies.head.asInstanceOf[ShuffleDependency[Int, Array[Byte], Array[Byte]]]
    sc.submitMapStage(dep).get()
    val before = outputsByExecutor(dep.shuffleId, shape.reduces)
    FaultJob.say(s"ELASTIC_MAP_DONE shuffle=${dep.shuffleId} outputs=${render(before)}")
    require(
      before.values.sum == shape.maps,
      s"map stage left ${before.values.sum} of ${shape.maps} outputs")
    val victim = before.maxBy(_._2)._1
    ListenerBus.drain(sc) // every map task's end counted before the baseline
    val mapsBefore = events.successfulMaps.get()
    val t0 = System.currentTimeMillis()
    val accepted = sc.schedulerBackend.asInstanceOf[ExecutorAllocationClient].decommissionExecutor(
      victim,
      ExecutorDecommissionInfo("rdma-shuffle ElasticJob: decommissioned after the map stage"),
      adjustTargetNumExecutors = true)
    require(accepted, s"the scheduler refused to decommission executor $victim")
    // Wait until no output is placed on the victim and every output is placed: all migrated.
    // If the victim leaves with outputs not migrated, the driver drops them; the reduce stage
    // then recomputes them, which the result line reports (maps_rerun) and the test refuses.
    var after = outputsByExecutor(dep.shuffleId, shape.reduces)
    def migrated = !after.contains(victim) && after.values.sum == shape.maps
    def lost = events.removed.contains(victim) && !after.contains(victim)
    while (!migrated && !lost) {
      if (System.currentTimeMillis() - t0 > WaitMs) {
        throw new IllegalStateException(
          s"outputs of executor $victim not migrated in ${WaitMs / 1000} s: ${render(after)}")
      }
      Thread.sleep(200)
      after = outputsByExecutor(dep.shuffleId, shape.reduces)
    }
    FaultJob.say(s"ELASTIC_MIGRATED victim=$victim outputs=${render(after)} " +
      s"missing=${shape.maps - after.values.sum} wait_ms=${System.currentTimeMillis() - t0}")
    reduceAndCheck(shuffled, "decommission", 1, seed, shape, identity, mapsBefore, events)
  }

  private def dynamic(sc: SparkContext, events: Events): Boolean = {
    val shape = DynamicShape
    val results = (1 to 2).map { round =>
      val removedBefore = events.removed.asScala.toSeq.sorted
      val seed = 9200L + round
      val rekey: Int => Int = k => k * 31 + 7
      val mapped = sc.parallelize(0 until shape.maps, shape.maps)
        .mapPartitions { it =>
          // The first tasks hold the stage until dynamic allocation has added executors (the
          // backlog asks for them), so that the round really runs on executors that joined
          // during it, however long they take to start.
          awaitPeers(MaxExecutors - 1)
          Thread.sleep(300)
          it
        }
        .flatMap(p => FaultJob.records(seed, p, shape))
      val first = mapped.partitionBy(new HashPartitioner(shape.reduces))
      val second = first.map { case (k, v) => (rekey(k), v) }.partitionBy(new HashPartitioner(3))
      val ok = reduceAndCheck(
        second,
        "dynamic",
        round,
        seed,
        shape,
        rekey,
        events.successfulMaps.get(),
        events)
      FaultJob.say(
        s"ELASTIC_ROUND round=$round executors=${events.seenInRound(round).mkString(",")} " +
          s"removed_before=${removedBefore.mkString(",")}")
      if (round == 1) {
        // Both shuffles are done with: clean them now (the ContextCleaner would, after a GC), so
        // that the executors hold no shuffle data and dynamic allocation may remove them.
        Seq(first, second).foreach { rdd =>
          val id = rdd.dependencies.head.asInstanceOf[ShuffleDependency[_, _, _]].shuffleId
          sc.cleaner.foreach(_.doCleanupShuffle(id, blocking = true))
        }
        awaitNoExecutors(sc, "round 1")
        events.nextRound()
      }
      ok
    }
    results.forall(identity)
  }

  private def service(sc: SparkContext, events: Events): Boolean = {
    val shape = DynamicShape
    val seed = 9300L
    val rekey: Int => Int = k => k * 31 + 7
    val mapped = sc.parallelize(0 until shape.maps, shape.maps)
      .mapPartitions { it =>
        // The first tasks hold the stage until two executors are up, so that the first
        // shuffle's blocks cross executors.
        awaitPeers(1)
        it
      }
      .flatMap(p => FaultJob.records(seed, p, shape))
    val first = mapped.partitionBy(new HashPartitioner(shape.reduces))
    val second = first.map { case (k, v) => (rekey(k), v) }.partitionBy(new HashPartitioner(3))
    val dep =
      second.dependencies.head.asInstanceOf[ShuffleDependency[Int, Array[Byte], Array[Byte]]]
    sc.submitMapStage(dep).get()
    val outputs = outputsByExecutor(dep.shuffleId, 3)
    FaultJob.say(s"ELASTIC_MAP_DONE shuffle=${dep.shuffleId} outputs=${render(outputs)}")
    // Idle executors go (the service keeps their outputs); wait until none is left.
    val t0 = System.currentTimeMillis()
    awaitNoExecutors(sc, "the map stages")
    ListenerBus.drain(sc)
    FaultJob.say(s"ELASTIC_RELEASED outputs=${render(outputsByExecutor(dep.shuffleId, 3))} " +
      s"removed=${events.removed.asScala.toSeq.sorted.mkString(",")} " +
      s"wait_ms=${System.currentTimeMillis() - t0}")
    events.nextRound()
    reduceAndCheck(second, "service", 1, seed, shape, rekey, events.successfulMaps.get(), events)
  }

  /** Reduces `rdd` (digest, count, misplaced records) and prints `ELASTIC_RESULT`. */
  private def reduceAndCheck(
      rdd: RDD[(Int, Array[Byte])],
      mode: String,
      round: Int,
      seed: Long,
      shape: FaultJob.Shape,
      rekey: Int => Int,
      mapsBefore: Int,
      events: Events): Boolean = {
    val sc = rdd.sparkContext
    val reduces = rdd.partitions.length
    val perPartition = FaultJob.digestPartitions(rdd, reduces)
    ListenerBus.drain(sc) // every task of this job counted
    val (expN, expSum) = FaultJob.expected(seed, shape, rekey)
    val n = perPartition.map(_._1).sum
    val sum = perPartition.map(_._2).sum
    val misplaced = perPartition.map(_._3).sum
    // Successful map tasks of this shuffle's lineage after the map stages (decommission,
    // service) or beyond the first run of each map stage (dynamic: 12 + 6 map tasks per round).
    val maps = events.successfulMaps.get() - mapsBefore
    val rerun = if (mode == "dynamic") maps - (shape.maps + shape.reduces) else maps
    val ok = n == expN && sum == expSum && misplaced == 0
    FaultJob.say(f"ELASTIC_RESULT mode=$mode round=$round records=$n sum=$sum%016x " +
      f"expected_records=$expN expected_sum=$expSum%016x misplaced=$misplaced " +
      f"maps_rerun=$rerun ok=$ok")
    ok
  }

  /** The executors dynamic allocation may have (`spark.dynamicAllocation.maxExecutors`). */
  val MaxExecutors = 3

  /**
   * Inside a task: waits until the driver knows `n` block managers besides this executor's
   * (the other executors), or [[WaitMs]]; never fails, a round without them is the test's to
   * judge.
   */
  private[jobs] def awaitPeers(n: Int): Unit = {
    val bm = SparkEnv.get.blockManager
    val deadline = System.currentTimeMillis() + WaitMs
    while (bm.master.getPeers(
        bm.blockManagerId).size < n && System.currentTimeMillis() < deadline) {
      Thread.sleep(200)
    }
  }

  /** Executor id -> map outputs of `shuffleId` the driver places on it. */
  private def outputsByExecutor(shuffleId: Int, reduces: Int): Map[String, Int] =
    try {
      SparkEnv.get.mapOutputTracker.getMapSizesByExecutorId(shuffleId, 0, Int.MaxValue, 0, reduces)
        .map { case (bm, blocks) =>
          bm.executorId -> blocks.collect { case (b: ShuffleBlockId, _, _) => b.mapId }.toSet.size
        }
        .toSeq.groupBy(_._1).map { case (e, xs) => e -> xs.map(_._2).sum }
    } catch {
      case _: MetadataFetchFailedException => Map.empty // an output is missing (not placed)
    }

  private def render(m: Map[String, Int]): String =
    m.toSeq.sortBy(_._1).map { case (e, n) => s"$e:$n" }.mkString(",")

  private def liveExecutors(sc: SparkContext): Int = sc.statusTracker.getExecutorInfos.length - 1

  /** Waits until dynamic allocation has removed every executor (idle after `after`). */
  private def awaitNoExecutors(sc: SparkContext, after: String): Unit = {
    val t0 = System.currentTimeMillis()
    while (liveExecutors(sc) > 0) {
      if (System.currentTimeMillis() - t0 > WaitMs) {
        throw new IllegalStateException(
          s"${liveExecutors(sc)} idle executors still up ${WaitMs / 1000} s after $after")
      }
      Thread.sleep(200)
    }
  }

  /** Executors added and removed, and successful map tasks, as the listener bus reports them. */
  private final class Events extends SparkListener {
    val added: java.util.Set[String] = ConcurrentHashMap.newKeySet[String]()
    val removed: java.util.Set[String] = ConcurrentHashMap.newKeySet[String]()
    val successfulMaps = new AtomicInteger()
    @volatile private var round = 1
    private val ranIn = new ConcurrentHashMap[Int, java.util.Set[String]]()

    def nextRound(): Unit = round += 1

    /** Executors that ran a task in `r`. */
    def seenInRound(r: Int): Seq[String] =
      Option(ranIn.get(r)).map(_.asScala.toSeq.sorted).getOrElse(Nil)

    override def onExecutorAdded(e: SparkListenerExecutorAdded): Unit = added.add(e.executorId)

    override def onExecutorRemoved(e: SparkListenerExecutorRemoved): Unit =
      removed.add(e.executorId)

    override def onTaskEnd(end: SparkListenerTaskEnd): Unit = {
      ranIn.computeIfAbsent(
        round,
        _ => ConcurrentHashMap.newKeySet[String]()).add(end.taskInfo.executorId)
      if (end.taskType == "ShuffleMapTask" && end.reason == org.apache.spark.Success) {
        successfulMaps.incrementAndGet()
      }
    }
  }
}
