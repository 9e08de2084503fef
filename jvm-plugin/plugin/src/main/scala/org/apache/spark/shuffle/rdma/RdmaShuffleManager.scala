/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.net.InetAddress
import java.util.concurrent.ConcurrentHashMap
import java.util.concurrent.atomic.AtomicBoolean

import scala.util.Try
import scala.util.control.NonFatal

import org.apache.spark.{ShuffleDependency, SparkConf, SparkEnv, TaskContext}
import org.apache.spark.internal.Logging
import org.apache.spark.network.netty.SparkTransportConf
import org.apache.spark.rpc.RpcEndpointRef
import org.apache.spark.shuffle._
import org.apache.spark.shuffle.sort.SortShuffleManager
import org.apache.spark.storage.{BlockId, BlockManagerId}
import org.apache.spark.util.Utils

/**
 * Spark shuffle manager backed by the native RDMA/TCP engine.
 *
 * {{{
 *   spark.shuffle.manager=org.apache.spark.shuffle.rdma.RdmaShuffleManager
 * }}}
 *
 * It is Spark's `SortShuffleManager` with the reads replaced: map tasks write with Spark's own
 * writers (chosen by Spark's own handle), and the resolver that serves blocks to Spark's Netty
 * transport stays Spark's. Being a subclass matters beyond reuse: Spark SQL's
 * `ShuffleExchangeExec` copies every row before a shuffle unless the manager
 * `isInstanceOf[SortShuffleManager]` (its writers serialize records at once, so rows need no
 * copy). Those writers are the ones used here, so the same holds, and DataFrame shuffles skip
 * a copy per row that a merely wrapping manager would pay. The plugin adds four seams:
 *  - (a) map-output commit: [[CommitNotifyingWriter]] tells [[MapOutputCommitHook]] (here: the
 *    engine's `registerMapOutput`) about each committed `.data/.index` pair;
 *  - (b) remote reads: [[RdmaShuffleReader]] runs Spark's `ShuffleBlockFetcherIterator` over a
 *    [[NativeBlockStoreClient]];
 *  - (c) endpoint discovery: executors register their engine with the driver's
 *    [[EngineRegistryEndpoint]], readers look executors up through a [[CachingEngineDirectory]];
 *  - (d) `unregisterShuffle` / `stop` forward to the engine. Counters: each reduce task reports
 *    the engine's counters to the driver, which logs every executor's latest
 *    `RDMA_SHUFFLE_ENGINE_STATS executor=<id> key=value...` line when it stops (executors try
 *    too, but standalone workers kill them right after the driver's shutdown command).
 *
 * When the native library cannot load (or [[FallbackPolicy]] says so) every shuffle is handed to
 * `SortShuffleManager`, after one warning per JVM; jobs run as without the plugin.
 *
 * Per-JVM engine: opened on first use where tasks run (eagerly at construction on Spark 4
 * executors, see [[SparkShims.envReadyAtConstruction]]), never on a driver that runs no tasks.
 */
class RdmaShuffleManager(conf: SparkConf, isDriver: Boolean)
  extends SortShuffleManager(conf) with ShuffleManagerContract with Logging {

  /** Spark's `(SparkConf)` form: a driver is recognised by its executor id. */
  def this(conf: SparkConf) =
    this(conf, conf.get("spark.executor.id", "") == SparkShuffleConstants.DriverId)

  /** Spark's no-argument form: settings come from `spark.*` system properties. */
  def this() = this(new SparkConf())

  import RdmaShuffleManager._

  /** Parsed settings; a bad value fails Spark's start with a message naming the key. */
  val settings: RdmaShuffleConf = RdmaShuffleConf(conf)

  /**
   * Spark's resolver, checking each data file's length against its index (issue 14), and
   * telling [[onMigratedOutput]] about map outputs migrated here by decommissioning.
   */
  override val shuffleBlockResolver: IndexShuffleBlockResolver = {
    val resolver = new CheckedIndexShuffleBlockResolver(conf)
    resolver.migrationHook = (shuffleId, mapId) => onMigratedOutput(shuffleId, mapId)
    resolver
  }

  /**
   * `spark.shuffle.service.enabled`: executors register their files with Spark's external
   * shuffle service as usual, the engine serves blocks while their executor lives, and the
   * service serves them after it has left (see [[NativeBlockStoreClient]]).
   */
  private val shuffleServiceEnabled: Boolean =
    conf.getBoolean("spark.shuffle.service.enabled", false)

  private val nativeFailure: Option[String] =
    if (!settings.enabled) None else Option(nativeLibrary().failure())

  private val fallbackPolicy: FallbackPolicy = createFallbackPolicy(settings, nativeFailure)

  /** Spark's memory settings the engines' native-memory bound comes from. */
  private val sparkMemory: Seq[(String, String)] = NativeMemoryBound.settings(conf)

  /**
   * How the engines of this application split their native memory (the engine's answer to
   * [[NativeBridge.memoryBudget]]), when engines may run at all.
   */
  private val memoryPlan: Map[String, String] =
    if (!settings.enabled || nativeFailure.isDefined ||
      fallbackPolicy.reasonToHandOverAll.isDefined) Map.empty
    else NativeEngine.parseLines(memoryBudget(settings.budgetConfig(sparkMemory))).toMap

  /**
   * Why the engines' memory cannot fit in the bound, when the plugin chose the sizes (then every
   * shuffle goes to Spark, with one warning). Settings the user chose that cannot fit (an
   * explicit `pool.capBytes`, a transport by name) fail the start instead, here. The engine
   * says which applies (`unfit_fallback`): `auto` already ended on the provider whose fixed
   * memory is smallest, and said which one it passed over and why.
   */
  private val memoryUnfit: Option[String] =
    memoryPlan.get("unfit").map { why =>
      if (!memoryPlan.get("unfit_fallback").contains("spark")) {
        throw new RdmaShuffleConfigException(why)
      }
      why
    }

  /** Set when no shuffle of this application can use the engine: none is started then. */
  private val handOverAll: Option[String] = fallbackPolicy.reasonToHandOverAll.orElse(memoryUnfit)

  /** Shuffle ids handed to Spark's sort shuffle (driver side), with the reason. */
  private val handedOver = new ConcurrentHashMap[Int, String]()

  /** Shuffles with at least one map output registered with this JVM's engine. */
  private val engineShuffles = ConcurrentHashMap.newKeySet[Int]()

  /** Map outputs whose registration failed, and the shuffles already warned about. */
  private val registrationFailures = new java.util.concurrent.atomic.AtomicLong()

  /** Map outputs migrated to this executor and registered with its engine. */
  private val migratedRegistrations = new java.util.concurrent.atomic.AtomicLong()
  private val registrationWarned = ConcurrentHashMap.newKeySet[Int]()

  @volatile private var engineState: EngineState = EngineState.NotStarted
  @volatile private var registryRef: Option[RpcEndpointRef] = None
  @volatile private var registryEndpoint: Option[EngineRegistryEndpoint] = None
  @volatile private var metricsSource: Option[EngineMetricsSource] = None
  private val stopped = new AtomicBoolean(false)

  logInfo(s"RdmaShuffleManager created (isDriver=$isDriver, native=" +
    s"${nativeFailure.fold("loaded")(_ => "unavailable")}, enabled=${settings.enabled})")
  nativeFailure.foreach { reason =>
    if (nativeWarningLogged.compareAndSet(false, true)) {
      logWarning(s"RDMA shuffle: native library lib${NativeLoader.LIB_NAME}.so could not be " +
        s"loaded ($reason). Every shuffle of this application is handed to Spark's built-in " +
        "sort shuffle; jobs run unchanged, without the native engine.")
    }
  }

  // Warnings the user must see once per application: the driver logs them (executors share
  // its settings, so they would only repeat them).
  if (isDriver) {
    settings.unknownKeyWarnings.zip(settings.unknownKeys).foreach { case (warning, key) =>
      if (warnedUnknownKeys.add(key)) logWarning(warning)
    }
    fallbackPolicy match {
      case p: DefaultFallbackPolicy if settings.enabled && nativeFailure.isEmpty =>
        p.encryption.foreach { setting =>
          if (encryptionWarningLogged.compareAndSet(false, true)) {
            val key = setting.takeWhile(_ != '=')
            logWarning(s"RDMA shuffle: $setting asks Spark to encrypt the traffic between " +
              "executors, and the RDMA shuffle engine does not encrypt yet. Every shuffle of " +
              "this application is handed to Spark's built-in sort shuffle, which honours " +
              s"$key. To move shuffles through the engine, turn $key off (only on a network " +
              "you trust); to keep encryption without this warning, remove " +
              "spark.shuffle.manager.")
          }
        }
      case _ =>
    }
  }
  if (isDriver) {
    memoryUnfit.foreach { reason =>
      if (memoryWarningLogged.compareAndSet(false, true)) {
        logWarning(s"RDMA shuffle: the engine's native memory does not fit in its bound " +
          s"($reason). Every shuffle of this application is handed to Spark's built-in sort " +
          "shuffle; jobs run unchanged.")
      }
    }
  }
  handOverAll.foreach(reason => logInfo(s"RDMA shuffle engine not started: $reason"))
  if (isDriver && shuffleServiceEnabled && handOverAll.isEmpty) {
    logInfo("RDMA shuffle beside the external shuffle service (spark.shuffle.service.enabled=" +
      "true): executors' engines serve the blocks of live executors; blocks of executors " +
      "that have left, and any block an engine fails to deliver, are fetched from the service")
  }

  // Spark 4: start now, so executors register with the driver as they come up. Spark 3.5 (and
  // any JVM without an env yet) starts on first use instead. Nothing to start when every
  // shuffle will be handed over anyway.
  if (SparkShims.envReadyAtConstruction && SparkEnv.get != null && settings.enabled &&
    nativeFailure.isEmpty && handOverAll.isEmpty) {
    if (isDriver) startRegistry() else engine()
  }

  // ---------------------------------------------------------------------------------------------
  // Overridable collaborators (tests subclass the manager, as Spark instantiates it by name).

  /** Loads (once per JVM) the native library. */
  protected def nativeLibrary(): NativeLoader.Outcome = NativeLoader.load()

  /** The per-shuffle hand-over decision. */
  protected def createFallbackPolicy(
      settings: RdmaShuffleConf,
      nativeFailure: Option[String]): FallbackPolicy =
    new DefaultFallbackPolicy(conf, settings, nativeFailure)

  /** Opens this JVM's engine. */
  protected def openEngine(config: String): ShuffleEngine = NativeEngine.open(config)

  /** The engine's memory split for `config` ([[NativeBridge.memoryBudget]]). */
  protected def memoryBudget(config: String): String = NativeBridge.memoryBudget(config)

  /** The directory readers resolve executors through (the driver registry, cached). */
  protected def readerDirectory(registry: CachingEngineDirectory): EngineDirectory = registry

  /**
   * Where the blocks of a reduce range are, like `SortShuffleManager.getReader` computes it.
   * Returns the blocks by address and whether batch fetch may be used.
   */
  protected def mapSizesByExecutorId(
      handle: BaseShuffleHandle[_, _, _],
      startMapIndex: Int,
      endMapIndex: Int,
      startPartition: Int,
      endPartition: Int)
      : (Iterator[(BlockManagerId, scala.collection.Seq[(BlockId, Long, Int)])], Boolean) = {
    val tracker = SparkEnv.get.mapOutputTracker
    if (handle.dependency.isShuffleMergeFinalizedMarked) {
      val res = tracker.getPushBasedShuffleMapSizesByExecutorId(
        handle.shuffleId,
        startMapIndex,
        endMapIndex,
        startPartition,
        endPartition)
      (res.iter, res.enableBatchFetch)
    } else {
      (
        tracker.getMapSizesByExecutorId(
          handle.shuffleId,
          startMapIndex,
          endMapIndex,
          startPartition,
          endPartition),
        true)
    }
  }

  // ---------------------------------------------------------------------------------------------
  // ShuffleManager

  override def registerShuffle[K, V, C](
      shuffleId: Int,
      dependency: ShuffleDependency[K, V, C]): ShuffleHandle = {
    val sortHandle = super.registerShuffle(shuffleId, dependency)
    memoryUnfit.orElse(fallbackPolicy.reasonToHandOver(dependency)) match {
      case Some(reason) =>
        handedOver.put(shuffleId, reason)
        logInfo(s"Shuffle $shuffleId handed to Spark's sort shuffle: $reason")
        sortHandle
      case None =>
        startRegistry()
        new RdmaShuffleHandle(
          shuffleId,
          dependency,
          sortHandle,
          nativeMemoryAccumulator(dependency))
    }
  }

  override def getWriter[K, V](
      handle: ShuffleHandle,
      mapId: Long,
      context: TaskContext,
      metrics: ShuffleWriteMetricsReporter): ShuffleWriter[K, V] = handle match {
    case h: RdmaShuffleHandle[K @unchecked, V @unchecked, _] =>
      val writer = super.getWriter[K, V](h.sortHandle, mapId, context, metrics)
      engine() match {
        case running @ EngineState.Running(eng, _, _) =>
          // The engine's native-memory peak for the map stage too (it serves as it writes).
          context.addTaskCompletionListener[Unit](_ => addNativePeak(h, statsOf(running)))
          val numPartitions = h.dependency.partitioner.numPartitions
          new CommitNotifyingWriter[K, V](
            writer,
            () =>
              commitHook(eng).onMapOutputCommitted(
                MapOutputCommit(
                  h.shuffleId,
                  mapId,
                  shuffleBlockResolver.getDataFile(h.shuffleId, mapId),
                  shuffleBlockResolver.getIndexFile(h.shuffleId, mapId),
                  numPartitions))
          )
        case _ => writer
      }
    case other =>
      super.getWriter[K, V](other, mapId, context, metrics)
  }

  override def getReader[K, C](
      handle: ShuffleHandle,
      startMapIndex: Int,
      endMapIndex: Int,
      startPartition: Int,
      endPartition: Int,
      context: TaskContext,
      metrics: ShuffleReadMetricsReporter): ShuffleReader[K, C] = handle match {
    case h: RdmaShuffleHandle[K @unchecked, _, C @unchecked] =>
      engine() match {
        case running @ EngineState.Running(_, _, client) =>
          // After each reduce task, tell the driver the engine's counters (see EngineStats),
          // and the shuffle's accumulator the engine's native-memory peak.
          context.addTaskCompletionListener[Unit](_ => addNativePeak(h, reportStats(running)))
          val (blocksByAddress, canEnableBatchFetch) =
            mapSizesByExecutorId(h, startMapIndex, endMapIndex, startPartition, endPartition)
          new RdmaShuffleReader[K, C](
            h,
            blocksByAddress,
            context,
            metrics,
            client,
            shouldBatchFetch = canEnableBatchFetch &&
              SortShuffleManager.canUseBatchFetch(startPartition, endPartition, context)
          )
        case _ =>
          // No engine in this JVM: Spark's reader over Netty (engines elsewhere do not matter,
          // every executor's Netty server still serves its files).
          super.getReader[K, C](
            h.sortHandle,
            startMapIndex,
            endMapIndex,
            startPartition,
            endPartition,
            context,
            metrics)
      }
    case other =>
      super.getReader[K, C](
        other,
        startMapIndex,
        endMapIndex,
        startPartition,
        endPartition,
        context,
        metrics)
  }

  override def unregisterShuffle(shuffleId: Int): Boolean = {
    handedOver.remove(shuffleId)
    registrationWarned.remove(shuffleId)
    if (engineShuffles.remove(shuffleId)) {
      engineState match {
        case EngineState.Running(eng, _, _) =>
          try eng.unregisterShuffle(shuffleId)
          catch {
            case NonFatal(e) => logWarning(s"Engine could not unregister shuffle $shuffleId", e)
          }
        case _ =>
      }
    }
    super.unregisterShuffle(shuffleId)
  }

  override def stop(): Unit = {
    if (stopped.compareAndSet(false, true)) {
      synchronized {
        engineState match {
          case running @ EngineState.Running(eng, directory, _) =>
            val executorId = Option(SparkEnv.get).map(_.executorId).getOrElse("?")
            logStats(executorId, statsOf(running))
            for (source <- metricsSource; env <- Option(SparkEnv.get)) {
              try env.metricsSystem.removeSource(source)
              catch { case NonFatal(_) => }
            }
            metricsSource = None
            directory.unregister(executorId)
            try eng.close()
            catch {
              case NonFatal(e) => logWarning("Closing the native shuffle engine failed", e)
            }
          case _ =>
        }
        logInfo(s"RdmaShuffleManager stopped (isDriver=$isDriver, engine=${engineState match {
            case EngineState.Running(_, _, _) => "closed"
            case EngineState.Unavailable(_) => "unavailable"
            case _ => "never started"
          }}, handed over shuffles=${handedOver.size})")
        engineState = EngineState.Stopped
        // The driver's log is the reliable place for every executor's final counters.
        registryEndpoint.foreach(_.statsByExecutor.toSeq.sortBy(_._1).foreach {
          case (executorId, stats) => logStats(executorId, stats)
        })
        for (ref <- registryRef; env <- Option(SparkEnv.get)) {
          try env.rpcEnv.stop(ref)
          catch { case NonFatal(_) => }
        }
        registryRef = None
      }
      super.stop()
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Introspection (tests, logs)

  /** Why a shuffle was handed to Spark's sort shuffle, if it was (driver side). */
  def handOverReason(shuffleId: Int): Option[String] = Option(handedOver.get(shuffleId))

  /** The block store client of this JVM's engine, if one is running. */
  private[rdma] def runningClient: Option[NativeBlockStoreClient] = engineState match {
    case EngineState.Running(_, _, client) => Some(client)
    case _ => None
  }

  /** The engine of this JVM, if one is running. */
  def runningEngine: Option[ShuffleEngine] = engineState match {
    case EngineState.Running(eng, _, _) => Some(eng)
    case _ => None
  }

  /** The driver's registry endpoint, if this is the driver and it was started. */
  private[rdma] def registry: Option[EngineRegistryEndpoint] = registryEndpoint

  // ---------------------------------------------------------------------------------------------
  // Internals

  /**
   * Registers each committed map output with the engine. A registration that fails (the
   * engine refuses the files, cannot register memory, ...) never fails the map task: the files
   * are Spark's own, so this executor's block manager serves them, and readers that get
   * `unknown_map_output` from this engine fetch them through Spark's block transfer
   * ([[NativeBlockStoreClient]]). One warning per shuffle says so.
   */
  private def commitHook(eng: ShuffleEngine): MapOutputCommitHook = new MapOutputCommitHook {
    override def onMapOutputCommitted(c: MapOutputCommit): Unit = register(eng, c)
  }

  /** Registers `c` with `eng` as [[commitHook]] describes; false if the engine refused it. */
  private def register(eng: ShuffleEngine, c: MapOutputCommit): Boolean =
    try {
      eng.registerMapOutput(c.shuffleId, c.mapId, c.dataFile, c.indexFile, c.numPartitions)
      engineShuffles.add(c.shuffleId)
      true
    } catch {
      case NonFatal(e) =>
        registrationFailures.incrementAndGet()
        if (registrationWarned.add(c.shuffleId)) {
          logWarning(s"RDMA shuffle: map output ${c.mapId} of shuffle ${c.shuffleId} could " +
            s"not be registered with the native engine ($e); it (and any other map output " +
            "of this shuffle whose registration fails) is served by Spark's own block " +
            "transfer service instead. The map task is not failed.")
        } else {
          logDebug(s"Map output ${c.mapId} of shuffle ${c.shuffleId} not registered: $e")
        }
        false
    }

  /** Map outputs whose registration with the engine failed (served by Spark instead). */
  def registrationFailureCount: Long = registrationFailures.get()

  /**
   * A map output another executor migrated here while decommissioning (see
   * [[CheckedIndexShuffleBlockResolver]]): registered with this executor's engine as if a map
   * task had committed it here, since the driver now sends its reducers here. Runs on a thread
   * of Spark's block transfer server, after the files are in place; Spark's callback has just
   * told the driver, so a reducer sent here in that moment fetches the output through Spark's
   * client, like one whose registration failed. A failure is logged and counted as a registration
   * failure; readers then get `unknown_map_output` from this engine and fetch the output
   * through Spark's block transfer ([[NativeBlockStoreClient]]), so the migration still counts.
   */
  private def onMigratedOutput(shuffleId: Int, mapId: Long): Unit =
    try {
      engine() match {
        case EngineState.Running(eng, _, _) =>
          val index = shuffleBlockResolver.getIndexFile(shuffleId, mapId)
          val entries = index.length() / 8
          if (entries < 1 || entries - 1 > Int.MaxValue) {
            registrationFailures.incrementAndGet()
            logWarning(s"RDMA shuffle: migrated map output $mapId of shuffle $shuffleId has an " +
              s"index of ${index.length()} bytes ($index); not registered with the engine, " +
              "Spark's block transfer serves it")
          } else {
            val commit = MapOutputCommit(
              shuffleId,
              mapId,
              shuffleBlockResolver.getDataFile(shuffleId, mapId),
              index,
              (entries - 1).toInt)
            if (register(eng, commit)) {
              migratedRegistrations.incrementAndGet()
              logInfo(s"Map output $mapId of shuffle $shuffleId, migrated to this executor, " +
                "registered with the RDMA shuffle engine")
            }
          }
        case _ => // no engine here: Spark's block manager serves the files, as for any output
      }
    } catch {
      case NonFatal(e) =>
        registrationFailures.incrementAndGet()
        logWarning(
          s"RDMA shuffle: migrated map output $mapId of shuffle $shuffleId could not " +
            "be registered with the engine; Spark's block transfer serves it",
          e)
    }

  /** The engine's counters plus this JVM's request routing counts. */
  private def statsOf(running: EngineState.Running): Seq[(String, String)] = {
    val native =
      try running.engine.stats
      catch {
        case NonFatal(e) => logWarning("Could not read engine stats", e); Nil
      }
    Seq(
      "transport" -> running.engine.transport,
      "native_requests" -> running.client.nativeRequestCount.toString,
      "delegated_requests" -> running.client.delegatedRequestCount.toString,
      "blocks_unknown_to_engine" -> running.client.unknownToEngineCount.toString,
      "registration_failures" -> registrationFailures.get().toString,
      "migrated_registrations" -> migratedRegistrations.get().toString,
      "service_fallback_blocks" -> running.client.serviceFallbackCount.toString,
      "departed_executors" -> running.client.departedExecutorCount.toString
    ) ++ native
  }

  /** Adds the engine's `native_peak_bytes` in `stats` to the shuffle's accumulator. */
  private def addNativePeak(h: RdmaShuffleHandle[_, _, _], stats: Seq[(String, String)]): Unit =
    for (acc <- h.nativeMemoryPeak; (_, v) <- stats.find(_._1 == "native_peak_bytes")) {
      Try(v.toLong).foreach(acc.add)
    }

  /** Reports the engine's counters to the driver; returns them. */
  private def reportStats(running: EngineState.Running): Seq[(String, String)] = {
    val stats = statsOf(running)
    val env = SparkEnv.get
    if (env != null) running.directory.reportStats(env.executorId, stats)
    stats
  }

  /**
   * A new named accumulator for the native-memory peak of `dependency`'s reduce tasks,
   * registered with the driver's context (see [[NativeMemoryAccumulator]]); `None` where there
   * is no context to register it with (managers made outside an application).
   */
  private def nativeMemoryAccumulator(
      dependency: ShuffleDependency[_, _, _]): Option[NativeMemoryAccumulator] =
    try {
      val acc = new NativeMemoryAccumulator
      dependency.rdd.sparkContext.register(acc, NativeMemoryAccumulator.Name)
      Some(acc)
    } catch {
      case NonFatal(e) =>
        logDebug(s"No native-memory accumulator for shuffle ${dependency.shuffleId}", e)
        None
    }

  /** One line, `key=value`, grepped by tests/spark: keep the format stable. */
  private def logStats(executorId: String, stats: Seq[(String, String)]): Unit =
    logInfo(
      s"$StatsMarker executor=$executorId " + stats.map { case (k, v) => s"$k=$v" }.mkString(" "))

  /** Starts the driver's registry endpoint once (driver only). */
  private def startRegistry(): Unit = {
    if (isDriver && registryRef.isEmpty) synchronized {
      if (registryRef.isEmpty && !stopped.get()) {
        val env = SparkEnv.get
        if (env != null) {
          val (endpoint, ref) = EngineRegistry.startDriverEndpoint(env.rpcEnv)
          registryEndpoint = Some(endpoint)
          registryRef = Some(ref)
        }
      }
    }
  }

  /** This JVM's engine, started on first call; never throws. */
  private def engine(): EngineState = {
    val s = engineState
    if (s != EngineState.NotStarted) s
    else synchronized {
      if (engineState == EngineState.NotStarted && !stopped.get()) {
        engineState = startEngine()
      }
      engineState
    }
  }

  private def startEngine(): EngineState = {
    if (!settings.enabled || nativeFailure.isDefined) {
      return EngineState.Unavailable(nativeFailure.getOrElse("disabled"))
    }
    if (handOverAll.isDefined) return EngineState.Unavailable(handOverAll.get)
    val env = SparkEnv.get
    if (env == null) return EngineState.NotStarted
    var opened: Option[ShuffleEngine] = None
    try {
      val secret =
        if (conf.getBoolean("spark.authenticate", false)) Option(env.securityManager.getSecretKey())
        else None
      val ownHost = executorHost(env)
      // Peers connect to the bind address when the user chose one, unless it is a wildcard.
      val host = settings.explicitBindHost
        .filterNot(h => Try(InetAddress.getByName(h).isAnyLocalAddress).getOrElse(false))
        .getOrElse(ownHost)
      val eng = openEngine(
        settings.engineConfig(env.executorId, conf.getAppId, secret, ownHost, sparkMemory))
      opened = Some(eng)
      val ref = if (isDriver) {
        startRegistry()
        registryRef.getOrElse(throw new IllegalStateException("driver registry not started"))
      } else {
        EngineRegistry.driverRef(conf, env.rpcEnv)
      }
      val directory = new CachingEngineDirectory(ref)
      directory.register(env.executorId, host, eng.port, eng.transport)
      val client = new NativeBlockStoreClient(
        eng,
        readerDirectory(directory),
        env.blockManager.blockStoreClient,
        SparkTransportConf.fromSparkConf(env.conf, "shuffle"),
        shuffleService = shuffleServiceEnabled
      )
      logInfo(s"RDMA shuffle engine of executor ${env.executorId} listening on $host:${eng.port} " +
        s"(transport ${eng.transport})")
      // One line saying why this transport (on a node or in a pod without RDMA: why tcp).
      logInfo(s"$TransportMarker executor=${env.executorId} transport=${eng.transport}: " +
        Try(eng.transportReason).getOrElse("?"))
      logMemoryBound(env.executorId, eng)
      val running = EngineState.Running(eng, directory, client)
      registerMetrics(env, running)
      running
    } catch {
      case NonFatal(e) =>
        opened.foreach(o =>
          try o.close()
          catch { case NonFatal(_) => })
        logWarning(
          "RDMA shuffle engine could not start on this executor; its shuffles are " +
            "written and read through Spark's own block transfer service",
          e)
        EngineState.Unavailable(e.toString)
    }
  }

  /**
   * The one line per executor that gives the engine's native-memory bound, where it came from
   * and how it is split (grepped by tests/spark: keep the format stable).
   */
  private def logMemoryBound(executorId: String, eng: ShuffleEngine): Unit = {
    val kv =
      try eng.stats.toMap
      catch { case NonFatal(_) => Map.empty[String, String] }
    def get(k: String) = kv.getOrElse(k, "?")
    val capFrom = if (settings.explicitPoolCap) RdmaShuffleConf.PoolCapKey else "the bound"
    logInfo(s"$MemoryMarker executor=$executorId bound=${get("native_bound_bytes")} " +
      s"pool_cap=${get("pool_cap_bytes")} fixed=${get("native_fixed_bytes")} " +
      s"transport=${eng.transport}: the engine's native memory is bounded by " +
      memoryPlan.get("bound_source").fold("nothing (no bound)")(src =>
        s"${get("native_bound_bytes")} bytes: $src") +
      s"; its pool's cap comes from $capFrom, and the pool waits for free buffers beyond it")
  }

  /**
   * The executor's host as Spark knows it: the host its block transfer service advertises
   * (known before the block manager registers, which Spark 4 does after creating this manager;
   * Spark's own executors bind their transport to it too), else the block manager's or the RPC
   * environment's host, else Spark's local host name. The engine binds it and peers connect to
   * it, so it is never all interfaces.
   */
  private def executorHost(env: SparkEnv): String = {
    val bm = Option(env.blockManager)
    bm.flatMap(b => Option(b.blockTransferService)).flatMap(t => Option(t.hostName))
      .orElse(bm.flatMap(b => Option(b.blockManagerId)).map(_.host))
      .orElse(Option(env.rpcEnv.address).map(_.host))
      .getOrElse(Utils.localHostNameForURI())
  }

  /**
   * Publishes the engine's counters through Spark's metrics system (source
   * [[EngineMetricsSource.Name]]), so every configured sink (CSV, Prometheus, JMX, ...) sees
   * them. Never fails the engine start.
   */
  private def registerMetrics(env: SparkEnv, running: EngineState.Running): Unit = {
    try {
      val source = new EngineMetricsSource(() => statsOf(running))
      env.metricsSystem.registerSource(source)
      metricsSource = Some(source)
    } catch {
      case NonFatal(e) => logWarning("Could not register the RDMA shuffle metrics source", e)
    }
  }
}

/** Constants shared by the manager and the test harness. */
object RdmaShuffleManager {

  /** Prefix of the engine-stats log line written at stop (grepped by tests/spark). */
  val StatsMarker = "RDMA_SHUFFLE_ENGINE_STATS"

  /** Prefix of the line each executor logs with its transport and why (docker/cluster.sh). */
  val TransportMarker = "RDMA_SHUFFLE_TRANSPORT"

  /** Prefix of the line each executor logs with its native-memory bound (tests/spark). */
  val MemoryMarker = "RDMA_SHUFFLE_MEMORY"

  /** Once per JVM: the warning that the engine's memory does not fit in its bound. */
  private val memoryWarningLogged = new AtomicBoolean(false)

  private val nativeWarningLogged = new AtomicBoolean(false)

  /** Once per JVM: the warning that encryption hands every shuffle to Spark. */
  private val encryptionWarningLogged = new AtomicBoolean(false)

  /** Unknown `spark.shuffle.rdma.*` keys already warned about in this JVM. */
  private val warnedUnknownKeys = ConcurrentHashMap.newKeySet[String]()
}

/** Where this JVM's engine is. */
private[rdma] sealed trait EngineState

private[rdma] object EngineState {
  case object NotStarted extends EngineState
  case object Stopped extends EngineState
  final case class Unavailable(reason: String) extends EngineState
  final case class Running(
      engine: ShuffleEngine,
      directory: CachingEngineDirectory,
      client: NativeBlockStoreClient) extends EngineState
}

/** Spark constants that are private in Spark. */
private[rdma] object SparkShuffleConstants {

  /** `SparkContext.DRIVER_IDENTIFIER`. */
  val DriverId = "driver"
}
