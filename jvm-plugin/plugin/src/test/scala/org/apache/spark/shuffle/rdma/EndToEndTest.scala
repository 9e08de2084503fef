/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import org.junit.Assert._
import org.junit.{After, Before, Test}

import org.apache.spark.{
  HashPartitioner,
  Partitioner,
  SparkConf,
  SparkContext,
  SparkEnv,
  SparkException
}
import org.apache.spark.shuffle.sort.SortShuffleManager

/**
 * Runs real Spark jobs in local mode through [[RdmaShuffleManager]] (with the loopback engine in
 * place of the native one): writes are committed to the engine, every reduce-side block is
 * fetched through the engine via Spark's own fetcher, and every lease comes back.
 */
class EndToEndTest {
  private var sc: SparkContext = _

  @Before def setUp(): Unit = LoopbackShuffleManager.reset()

  @After def tearDown(): Unit = {
    if (sc != null) sc.stop()
    sc = null
    LoopbackShuffleManager.reset()
  }

  private def start(extra: (String, String)*): SparkContext = {
    val conf = new SparkConf()
      .setMaster("local[2]")
      .setAppName("rdma-shuffle-e2e")
      .set("spark.shuffle.manager", classOf[LoopbackShuffleManager].getName)
      .set("spark.ui.enabled", "false")
      .set("spark.shuffle.io.retryWait", "10ms")
    extra.foreach { case (k, v) => conf.set(k, v) }
    sc = new SparkContext(conf)
    sc
  }

  private def manager: LoopbackShuffleManager =
    SparkEnv.get.shuffleManager.asInstanceOf[LoopbackShuffleManager]

  @Test def reduceByKeyAndSortGoThroughTheEngine(): Unit = {
    start()
    val data = (1 to 20000).map(i => (i % 101, i.toLong))
    val expected = data.groupBy(_._1).map { case (k, vs) => (k, vs.map(_._2).sum) }
    val got = sc.parallelize(data, 4).reduceByKey(_ + _, 5).collect().toMap
    assertEquals(expected, got)

    // sortByKey exercises the key-ordering branch of the reader (range partitioner, 2 shuffles).
    val sorted = sc.parallelize(data.map(_.swap), 3).sortByKey(numPartitions = 4).keys.collect()
    assertArrayEquals(data.map(_._2).sorted.toArray, sorted)

    val engine = LoopbackShuffleManager.engine
    assertNotNull("engine opened where tasks ran", engine)
    // 4 map tasks for reduceByKey, 3 for the sort's sample-free shuffle.
    assertEquals(4 + 3, engine.registered.get())
    assertTrue("blocks were served by the engine", engine.blocksServed.get() > 0)
    assertEquals("every lease released", 0, engine.outstanding)
    assertEquals("no lease released twice", 0, engine.doubleReleases.get())
    assertTrue(manager.runningEngine.isDefined)
    // Reduce tasks report the engine's counters to the driver's registry (one-way, async).
    val registry = manager.registry.get
    val deadline = System.nanoTime() + 10L * 1000 * 1000 * 1000
    def reported = registry.statsByExecutor.get("driver").map(_.toMap).getOrElse(Map.empty)
    while (reported.get("native_requests").forall(_.toLong == 0) && System.nanoTime() < deadline) {
      Thread.sleep(10)
    }
    assertTrue(s"stats reported: $reported", reported("native_requests").toLong > 0)
    assertEquals(engine.blocksServed.get().toString, reported("blocks_fetched"))
    assertTrue(LoopbackShuffleManager.lastConfig.contains("spark.executor.id=driver\n"))
  }

  @Test def transientFailuresAreRetriedBySpark(): Unit = {
    // The first attempt of every block fails with an I/O error; Spark's retrying transferor
    // (spark.shuffle.io.maxRetries=3) must fetch it again and the job must succeed.
    LoopbackShuffleManager.failure = (_, attempt) =>
      if (attempt == 1) Some(("io", "injected transient failure")) else None
    start()
    val got = sc.parallelize(1 to 1000, 2).map(i => (i % 10, 1)).reduceByKey(_ + _, 3)
      .collect().toMap
    assertEquals((0 until 10).map(k => (k, 100)).toMap, got)
    val engine = LoopbackShuffleManager.engine
    assertEquals(0, engine.outstanding)
    assertTrue(engine.blocksServed.get() > 0)
  }

  @Test def permanentFailuresBecomeFetchFailed(): Unit = {
    LoopbackShuffleManager.failure = (_, _) => Some(("not_found", "injected missing block"))
    start("spark.stage.maxConsecutiveAttempts" -> "1")
    val e = assertThrows(
      classOf[SparkException],
      () =>
        sc.parallelize(1 to 100, 2).map(i => (i % 10, 1)).reduceByKey(_ + _, 3).collect())
    val text = e.toString + Option(e.getCause).map(_.toString).getOrElse("")
    assertTrue(
      s"fetch failure surfaced: $text",
      text.contains("FetchFailed") ||
        text.contains("injected missing block"))
    assertTrue(s"our message surfaced: $text", text.contains("injected missing block"))
  }

  @Test def aRefusedRegistrationFallsBackToSparksTransfer(): Unit = {
    // Issue 14: the engine refuses the map outputs with an even map id. Before, the refusal
    // failed every attempt of those map tasks and the job aborted; now the writer logs one
    // warning, and readers fetch those outputs through Spark's own block transfer service.
    LoopbackShuffleManager.refuseRegistration = (_, mapId) => mapId % 2 == 0
    LoopbackShuffleManager.realHost = true
    start("spark.shuffle.readHostLocalDisk" -> "false", "spark.task.maxFailures" -> "1")
    val data = (1 to 20000).map(i => (i % 101, i.toLong))
    val expected = data.groupBy(_._1).map { case (k, vs) => (k, vs.map(_._2).sum) }
    val got = sc.parallelize(data, 4).reduceByKey(_ + _, 5).collect().toMap
    assertEquals(expected, got)
    val engine = LoopbackShuffleManager.engine
    val m = manager
    assertEquals("2 of 4 map outputs refused", 2L, m.registrationFailureCount)
    assertEquals(2, engine.registered.get())
    val client = m.runningClient.get
    assertEquals("blocks of the 2 refused outputs x 5 reducers", 10L, client.unknownToEngineCount)
    assertTrue("the rest came through the engine", engine.blocksServed.get() > 0)
    assertEquals(0, engine.outstanding)
  }

  @Test def unregisterShuffleReachesTheEngine(): Unit = {
    start()
    val rdd = sc.parallelize(1 to 100, 2).map(i => (i % 10, 1)).reduceByKey(_ + _, 3)
    assertEquals(10, rdd.count())
    val engine = LoopbackShuffleManager.engine
    val shuffleId = 0
    assertEquals(2, engine.outputsOf(shuffleId))
    assertTrue(manager.unregisterShuffle(shuffleId))
    assertTrue(engine.unregisteredShuffles.contains(shuffleId))
    assertEquals(0, engine.outputsOf(shuffleId))
  }

  @Test def stopClosesTheEngine(): Unit = {
    start()
    sc.parallelize(1 to 100, 2).map(i => (i % 10, 1)).reduceByKey(_ + _, 3).count()
    val engine = LoopbackShuffleManager.engine
    sc.stop()
    sc = null
    assertTrue(engine.closed)
    import scala.collection.JavaConverters._
    val ours = Thread.getAllStackTraces.keySet().asScala
      .filter(t => t.isAlive && t.getName.startsWith("rdma-shuffle") && !t.isDaemon)
    assertTrue(s"non-daemon plugin threads left: $ours", ours.isEmpty)
  }

  @Test def sparkSqlSkipsTheRowCopyBeforeShuffles(): Unit = {
    start()
    // Spark SQL copies every row before a shuffle unless the manager is a SortShuffleManager
    // (ShuffleExchangeExec.needToCopyObjectsBeforeShuffle). The plugin writes with Spark's sort
    // writers, so it must be one, and DataFrame shuffles must not pay a copy per row.
    assertTrue(manager.isInstanceOf[SortShuffleManager])
    val exchange = Class.forName("org.apache.spark.sql.execution.exchange.ShuffleExchangeExec$")
    val method = exchange.getDeclaredMethod("needToCopyObjectsBeforeShuffle", classOf[Partitioner])
    method.setAccessible(true)
    val module = exchange.getField("MODULE$").get(null)
    // 32: the bypass-merge writer; 1000: the serialized (unsafe) writer. Neither buffers rows.
    for (partitions <- Seq(32, 1000)) {
      assertEquals(
        s"row copy before a shuffle into $partitions partitions",
        false,
        method.invoke(module, new HashPartitioner(partitions)))
    }
  }

  @Test def engineCountersAreASparkMetricsSource(): Unit = {
    start()
    sc.parallelize(1 to 20000, 4).map(i => (i % 101, i.toLong)).reduceByKey(_ + _, 5).count()
    val engine = LoopbackShuffleManager.engine
    val sources = SparkEnv.get.metricsSystem.getSourcesByName(EngineMetricsSource.Name)
    assertEquals(1, sources.size)
    val gauges = sources.head.metricRegistry.getGauges
    def read(key: String): Long = gauges.get(key).getValue.asInstanceOf[Long]
    assertTrue(engine.bytesServed.get() > 0)
    // Read twice: the first read of a report may still be the snapshot taken at registration.
    read("bytes_fetched")
    assertEquals(engine.bytesServed.get(), read("bytes_fetched"))
    assertEquals(engine.blocksServed.get(), read("blocks_fetched"))
    assertTrue("the plugin's own routing counters too", read("native_requests") > 0)
    assertNull("non-numeric keys are not gauges", gauges.get("transport"))
    sc.stop()
    sc = null
    assertTrue(
      "removed with the engine",
      SparkEnv.get == null || SparkEnv.get.metricsSystem.getSourcesByName("rdmaShuffle").isEmpty)
  }

  @Test def encryptionHandsEveryShuffleToSparkAndStartsNoEngine(): Unit = {
    start("spark.authenticate" -> "true", "spark.network.crypto.enabled" -> "true")
    val got = sc.parallelize(1 to 100, 2).map(i => (i % 10, 1)).reduceByKey(_ + _, 3).collect()
    assertEquals(10, got.length)
    assertTrue(
      manager.handOverReason(0).toString,
      manager.handOverReason(0).exists(_.startsWith("spark.network.crypto.enabled=true")))
    assertNull("no engine: nothing may move in clear text", LoopbackShuffleManager.engine)
    assertTrue(manager.runningEngine.isEmpty)
  }

  /**
   * Memory the plugin sized that does not fit (the engine's `unfit_fallback=spark`): every
   * shuffle goes to Spark with the engine's reason, no engine starts, the job runs.
   */
  @Test def memoryThePluginChoseThatDoesNotFitHandsShufflesToSpark(): Unit = {
    LoopbackShuffleManager.budget = "unfit=too small for any provider\nunfit_fallback=spark\n"
    start()
    val got = sc.parallelize(1 to 100, 2).map(i => (i % 10, 1)).reduceByKey(_ + _, 3).collect()
    assertEquals(10, got.length)
    assertEquals(Some("too small for any provider"), manager.handOverReason(0))
    assertNull("no engine when its memory does not fit", LoopbackShuffleManager.engine)
  }

  /**
   * Settings the user chose that do not fit (a transport by name, an explicit pool cap: the
   * engine's `unfit_fallback=none`) fail the start with the engine's reason, whatever provider
   * it names: the JVM reads no provider name.
   */
  @Test def memoryTheUserChoseThatDoesNotFitFailsTheStart(): Unit = {
    for (transport <- Seq("tcp", "shm", "ofi")) {
      LoopbackShuffleManager.budget =
        s"${transport}_unfit=needs more\nunfit=over $transport: needs more\nunfit_fallback=none\n"
      val e = assertThrows(
        classOf[Exception],
        () => start("spark.shuffle.rdma.transport" -> transport))
      var cause: Throwable = e
      while (cause != null && !cause.isInstanceOf[RdmaShuffleConfigException]) {
        cause = cause.getCause
      }
      assertNotNull(s"transport=$transport: $e", cause)
      assertEquals(s"over $transport: needs more", cause.getMessage)
      if (sc != null) sc.stop()
      sc = null
    }
  }

  @Test def disabledPluginHandsShufflesOver(): Unit = {
    start("spark.shuffle.rdma.enabled" -> "false")
    val got = sc.parallelize(1 to 100, 2).map(i => (i % 10, 1)).reduceByKey(_ + _, 3).collect()
    assertEquals(10, got.length)
    assertEquals(Some("spark.shuffle.rdma.enabled=false"), manager.handOverReason(0))
    assertNull("no engine when disabled", LoopbackShuffleManager.engine)
  }
}
