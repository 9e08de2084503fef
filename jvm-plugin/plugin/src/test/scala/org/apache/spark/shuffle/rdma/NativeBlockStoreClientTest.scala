/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.{File, IOException}
import java.nio.ByteBuffer
import java.util.concurrent.{ConcurrentLinkedQueue, CountDownLatch, TimeUnit}

import scala.collection.JavaConverters._

import org.junit.Assert._
import org.junit.Test

import org.apache.spark.network.buffer.{ManagedBuffer, NioManagedBuffer}
import org.apache.spark.network.shuffle.{
  BlockFetchingListener,
  BlockStoreClient,
  DownloadFile,
  DownloadFileManager,
  SimpleDownloadFile
}
import org.apache.spark.network.util.{MapConfigProvider, TransportConf}

class NativeBlockStoreClientTest {

  private def transportConf(maxRetries: Int): TransportConf =
    new TransportConf(
      "shuffle",
      new MapConfigProvider(Map(
        "spark.shuffle.io.maxRetries" -> maxRetries.toString,
        "spark.shuffle.io.retryWait" -> "1ms").asJava))

  /**
   * Spark's client stand-in: records what was delegated; with `serve`, answers it (the block
   * id's bytes), failing the ids in `failing` with `failure`.
   */
  private class RecordingSparkClient(
      serve: Boolean = false,
      failing: Set[String] = Set.empty,
      failure: Throwable = new IOException("service down"))
    extends BlockStoreClient {
    val calls = new ConcurrentLinkedQueue[(String, Int, String, Seq[String])]()
    override def fetchBlocks(
        host: String,
        port: Int,
        execId: String,
        blockIds: Array[String],
        listener: BlockFetchingListener,
        dfm: DownloadFileManager): Unit = {
      calls.add((host, port, execId, blockIds.toSeq))
      if (serve) {
        blockIds.foreach { id =>
          if (failing.contains(id)) listener.onBlockFetchFailure(id, failure)
          else listener.onBlockFetchSuccess(id, new NioManagedBuffer(ByteBuffer.wrap(id.getBytes)))
        }
      }
    }
    override def close(): Unit = ()
  }

  /** An engine whose fetch answers are scripted per call (call number is 1-based). */
  private class ScriptedEngine(
      script: (Int, IndexedSeq[BlockRange], FetchCallback) => Unit,
      toFile: (BlockRange, File, FetchCallback) => Unit = (_, _, cb) =>
        cb.onFailure(0, "other", "no file script"))
    extends ShuffleEngine {
    val streamed = new ConcurrentLinkedQueue[(BlockRange, File)]()
    override def fetchBlockToFile(
        host: String,
        port: Int,
        block: BlockRange,
        file: File,
        callback: FetchCallback): Unit = {
      streamed.add((block, file))
      toFile(block, file, callback)
    }
    val released = new ConcurrentLinkedQueue[Long]()
    val requests = new ConcurrentLinkedQueue[(String, Int, IndexedSeq[BlockRange])]()
    @volatile private var calls = 0
    override def port: Int = 1
    override def transport: String = "scripted"
    override def registerMapOutput(s: Int, m: Long, d: File, i: File, n: Int): Unit = ()
    override def unregisterShuffle(shuffleId: Int): Int = 0
    override def fetchBlocks(
        host: String,
        port: Int,
        blocks: IndexedSeq[BlockRange],
        callback: FetchCallback): Unit = {
      requests.add((host, port, blocks))
      calls += 1
      script(calls, blocks, callback)
    }
    override def releaseLease(lease: Long): Unit = released.add(lease)
    override def stats: Seq[(String, String)] = Nil
    override def close(): Unit = ()
  }

  private class RecordingListener(retain: Boolean, expected: Int) extends BlockFetchingListener {
    val ok = new ConcurrentLinkedQueue[(String, Array[Byte])]()
    val kept = new ConcurrentLinkedQueue[ManagedBuffer]()
    val failed = new ConcurrentLinkedQueue[(String, Throwable)]()
    val done = new CountDownLatch(expected)
    override def onBlockFetchSuccess(blockId: String, buf: ManagedBuffer): Unit = {
      val bb = buf.nioByteBuffer()
      val bytes = new Array[Byte](bb.remaining())
      bb.get(bytes)
      ok.add((blockId, bytes))
      if (retain) { buf.retain(); kept.add(buf) }
      done.countDown()
    }
    override def onBlockFetchFailure(blockId: String, e: Throwable): Unit = {
      failed.add((blockId, e))
      done.countDown()
    }
    def await(): Unit = assertTrue("listener completed", done.await(10, TimeUnit.SECONDS))
  }

  private def bytesOf(n: Int, seed: Int): ByteBuffer = {
    val b = ByteBuffer.allocateDirect(n)
    (0 until n).foreach(i => b.put(((i * 31 + seed) & 0xff).toByte))
    b.flip()
    b
  }

  private val remote = new EngineDirectory {
    override def lookup(executorId: String): Option[EngineAddress] =
      if (executorId == "exec-2") Some(EngineAddress("10.1.2.3", 4000)) else None
  }

  @Test def blockIdsMapToRanges(): Unit = {
    assertEquals(
      Some(IndexedSeq(BlockRange(1, 2L, 3, 4), BlockRange(1, 9L, 3, 7))),
      NativeBlockStoreClient.toRanges(Array("shuffle_1_2_3", "shuffle_1_9_3_7")))
    assertEquals(None, NativeBlockStoreClient.toRanges(Array("shuffle_1_2_3", "rdd_1_2")))
    assertEquals(None, NativeBlockStoreClient.toRanges(Array("shuffleChunk_1_0_2_3")))
    assertEquals(None, NativeBlockStoreClient.toRanges(Array("not a block")))
  }

  @Test def executorsWithoutEngineAndOtherBlocksGoToSpark(): Unit = {
    val spark = new RecordingSparkClient
    val engine = new ScriptedEngine((_, _, _) => fail("engine must not be used"))
    val client = new NativeBlockStoreClient(engine, remote, spark, transportConf(0))
    val l = new RecordingListener(false, 0)
    client.fetchBlocks("h1", 7337, "exec-1", Array("shuffle_0_1_2"), l, null)
    client.fetchBlocks("h2", 7338, "exec-2", Array("shuffleChunk_0_0_1_2"), l, null)
    assertEquals(
      Seq(
        ("h1", 7337, "exec-1", Seq("shuffle_0_1_2")),
        ("h2", 7338, "exec-2", Seq("shuffleChunk_0_0_1_2"))),
      spark.calls.asScala.toSeq)
    assertEquals(2L, client.delegatedRequestCount)
    assertEquals(0L, client.nativeRequestCount)
  }

  @Test def blocksReachTheListenerAndLeasesComeBack(): Unit = {
    @volatile var engineThread: Thread = null
    val engine = new ScriptedEngine((_, blocks, cb) => {
      // Answer out of order, from another thread, like the native progress thread.
      val t = new Thread(() => {
        cb.onBlock(1, bytesOf(10, 1), 101L)
        cb.onBlock(0, bytesOf(3, 0), 100L)
      })
      engineThread = t
      t.start()
    })
    val client =
      new NativeBlockStoreClient(engine, remote, new RecordingSparkClient, transportConf(0))
    val l = new RecordingListener(retain = true, expected = 2)
    client.fetchBlocks("ignored", 1, "exec-2", Array("shuffle_4_5_6", "shuffle_4_5_7_9"), l, null)
    l.await()
    // The client drops its own reference after the listener returns, on the engine thread.
    engineThread.join(10000)
    val (host, port, ranges) = engine.requests.peek()
    assertEquals(("10.1.2.3", 4000), (host, port))
    assertEquals(IndexedSeq(BlockRange(4, 5L, 6, 7), BlockRange(4, 5L, 7, 9)), ranges)
    val got = l.ok.asScala.toMap
    assertArrayEquals(bytes(bytesOf(3, 0)), got("shuffle_4_5_6"))
    assertArrayEquals(bytes(bytesOf(10, 1)), got("shuffle_4_5_7_9"))
    // The listener retained both: nothing released until it lets go.
    assertTrue(engine.released.isEmpty)
    l.kept.asScala.foreach(_.release())
    assertEquals(Set(100L, 101L), engine.released.asScala.toSet)
    assertEquals(2, engine.released.size())
    assertEquals(1L, client.nativeRequestCount)
  }

  private def bytes(b: ByteBuffer): Array[Byte] = {
    val d = b.duplicate(); val a = new Array[Byte](d.remaining()); d.get(a); a
  }

  @Test def failureKindsMapToRetryableOrNot(): Unit = {
    // Kinds as the native engine names them (FailureCode::name): transient ones become
    // IOExceptions, which Spark's RetryingBlockTransferor retries; permanent ones do not.
    val kinds = Seq(
      "timeout" -> false, // final: the peer was already silent for the whole timeout
      "peer_gone" -> true,
      "pool_exhausted" -> true,
      "pull_failed" -> true,
      "io" -> true,
      "auth_refused" -> false,
      "bad_range" -> false,
      "corrupt" -> false,
      "something_new" -> false
    )
    val engine = new ScriptedEngine((_, _, cb) => {
      kinds.zipWithIndex.foreach { case ((kind, _), i) => cb.onFailure(i, kind, s"$kind happened") }
    })
    val client =
      new NativeBlockStoreClient(engine, remote, new RecordingSparkClient, transportConf(0))
    val l = new RecordingListener(false, kinds.size)
    val ids = kinds.indices.map(i => s"shuffle_0_1_$i").toArray
    client.fetchBlocks("h", 1, "exec-2", ids, l, null)
    l.await()
    val byId = l.failed.asScala.toMap
    kinds.zipWithIndex.foreach { case ((kind, transient), i) =>
      val e = byId(s"shuffle_0_1_$i")
      val cause = if (transient) {
        assertTrue(s"$kind should reach Spark as an IOException", e.isInstanceOf[IOException])
        e.getCause.asInstanceOf[RdmaShuffleException]
      } else {
        assertTrue(s"$kind should not be retried", e.isInstanceOf[RdmaShuffleException])
        e.asInstanceOf[RdmaShuffleException]
      }
      assertEquals(kind, cause.kind())
      assertTrue(e.getMessage.contains("exec-2"))
      assertTrue(e.getMessage.contains("10.1.2.3:4000"))
    }
  }

  @Test def blocksTheEngineDoesNotHaveAreFetchedThroughSpark(): Unit = {
    // Issue 14: a map output whose registration failed on the serving executor is unknown to
    // its engine, but its block manager serves Spark's files: the block goes to Spark's client.
    for (retries <- Seq(0, 2)) {
      val engine = new ScriptedEngine((_, blocks, cb) => {
        blocks.zipWithIndex.foreach { case (b, i) =>
          b.mapId match {
            case 1L => cb.onBlock(i, bytesOf(3, 1), 10L + i)
            case 2L => cb.onFailure(i, "unknown_map_output", "map output not registered")
            case _ => cb.onFailure(i, "unknown_shuffle", "no map outputs of shuffle 0")
          }
        }
      })
      val spark = new RecordingSparkClient(serve = true)
      val client = new NativeBlockStoreClient(engine, remote, spark, transportConf(retries))
      val l = new RecordingListener(false, 3)
      val ids = Array("shuffle_0_1_0", "shuffle_0_2_0", "shuffle_0_3_1_4")
      client.fetchBlocks("h2", 7338, "exec-2", ids, l, null)
      l.await()
      assertTrue(s"failures: ${l.failed.asScala}", l.failed.isEmpty)
      val got = l.ok.asScala.map { case (id, b) => (id, b.toSeq) }.toMap
      assertEquals(bytes(bytesOf(3, 1)).toSeq, got("shuffle_0_1_0"))
      assertEquals("shuffle_0_2_0".getBytes.toSeq, got("shuffle_0_2_0"))
      assertEquals("shuffle_0_3_1_4".getBytes.toSeq, got("shuffle_0_3_1_4"))
      assertEquals(
        Set(
          ("h2", 7338, "exec-2", Seq("shuffle_0_2_0")),
          ("h2", 7338, "exec-2", Seq("shuffle_0_3_1_4"))),
        spark.calls.asScala.toSet)
      assertEquals(2L, client.unknownToEngineCount)
      assertEquals(Seq(10L), engine.released.asScala.toSeq)
    }
  }

  @Test def duplicateResultsAreDroppedAndTheirLeaseReleased(): Unit = {
    val engine = new ScriptedEngine((_, _, cb) => {
      cb.onBlock(0, bytesOf(4, 0), 1L)
      cb.onBlock(0, bytesOf(4, 0), 2L)
      cb.onFailure(0, "io", "late failure for a finished block")
      cb.onBlock(5, bytesOf(4, 0), 3L)
    })
    val client =
      new NativeBlockStoreClient(engine, remote, new RecordingSparkClient, transportConf(0))
    val l = new RecordingListener(false, 1)
    client.fetchBlocks("h", 1, "exec-2", Array("shuffle_0_1_0"), l, null)
    l.await()
    assertEquals(1, l.ok.size())
    assertTrue(l.failed.isEmpty)
    assertEquals(Set(1L, 2L, 3L), engine.released.asScala.toSet)
  }

  @Test def transientFailuresAreRetriedWithSparksPolicy(): Unit = {
    val engine = new ScriptedEngine((call, blocks, cb) => {
      if (call == 1) {
        cb.onBlock(0, bytesOf(2, 0), 10L)
        cb.onFailure(1, "connect", "connection refused")
      } else {
        // Spark retries only what is still outstanding.
        assertEquals(IndexedSeq(BlockRange(0, 1L, 1, 2)), blocks)
        cb.onBlock(0, bytesOf(2, 1), 11L)
      }
    })
    val client =
      new NativeBlockStoreClient(engine, remote, new RecordingSparkClient, transportConf(2))
    val l = new RecordingListener(false, 2)
    client.fetchBlocks("h", 1, "exec-2", Array("shuffle_0_1_0", "shuffle_0_1_1"), l, null)
    l.await()
    assertTrue(l.failed.isEmpty)
    assertEquals(Set("shuffle_0_1_0", "shuffle_0_1_1"), l.ok.asScala.map(_._1).toSet)
    assertEquals(2, engine.requests.size())
    // The retry runs on Spark's retry thread, which drops the client's reference after the
    // listener returned: give it a bounded moment.
    val deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10)
    while (engine.released.size() < 2 && System.nanoTime() < deadline) Thread.sleep(5)
    assertEquals(Set(10L, 11L), engine.released.asScala.toSet)
  }

  @Test def transientFailuresTowardsADeadExecutorAreNotRetried(): Unit = {
    // Issue 14 / SPARK-27637: Spark's own client asks the driver before it retries; a fetch from
    // an executor the driver has removed fails at once instead of after maxRetries x retryWait.
    val engine = new ScriptedEngine((_, _, cb) => {
      cb.onBlock(0, bytesOf(2, 0), 10L)
      cb.onFailure(1, "peer_gone", "connection reset by peer")
      cb.onFailure(2, "io", "broken pipe")
    })
    val asked = new ConcurrentLinkedQueue[String]()
    val client = new NativeBlockStoreClient(
      engine,
      remote,
      new RecordingSparkClient,
      transportConf(3),
      executorAlive = id => { asked.add(id); false })
    val l = new RecordingListener(false, 3)
    client.fetchBlocks(
      "h",
      1,
      "exec-2",
      Array("shuffle_0_1_0", "shuffle_0_1_1", "shuffle_0_1_2"),
      l,
      null)
    l.await()
    assertEquals("no retry towards a dead executor", 1, engine.requests.size())
    val failed = l.failed.asScala.toMap
    assertEquals(Set("shuffle_0_1_1", "shuffle_0_1_2"), failed.keySet)
    failed.values.foreach { e =>
      assertTrue(s"not retryable: $e", e.isInstanceOf[org.apache.spark.ExecutorDeadException])
      assertTrue(e.getMessage, e.getMessage.contains("executor exec-2 engine 10.1.2.3:4000"))
      assertTrue(e.getMessage, e.getMessage.contains("the driver reports executor exec-2 dead"))
    }
    assertEquals("one question per request", Seq("exec-2"), asked.asScala.toSeq)
    assertEquals(2L, client.deadExecutorFailureCount)
  }

  @Test def aTimeoutIsReportedAtOnceWithoutRetries(): Unit = {
    // Issue 14: FetchFailed within spark.shuffle.rdma.fetchTimeout of a cut peer, not after
    // maxRetries more rounds of retryWait + connectTimeout; the driver is not even asked.
    val engine = new ScriptedEngine((_, _, cb) =>
      cb.onFailure(0, "timeout", "no progress for 10000 ms while waiting for blocks"))
    val client = new NativeBlockStoreClient(
      engine,
      remote,
      new RecordingSparkClient,
      transportConf(3),
      executorAlive = _ => { fail("a timeout needs no liveness question"); true })
    val l = new RecordingListener(false, 1)
    client.fetchBlocks("h", 1, "exec-2", Array("shuffle_0_1_0"), l, null)
    l.await()
    assertEquals(1, engine.requests.size())
    val e = l.failed.peek()._2
    assertTrue(s"not retryable: $e", e.isInstanceOf[RdmaShuffleException])
    assertEquals("timeout", e.asInstanceOf[RdmaShuffleException].kind())
    assertTrue(e.getMessage, e.getMessage.contains("not retried"))
  }

  @Test def aFetchThatCannotStartTowardsADeadExecutorIsNotRetried(): Unit = {
    val engine = new ScriptedEngine((_, _, _) =>
      throw new RdmaShuffleException("connect", "connection refused"))
    val client = new NativeBlockStoreClient(
      engine,
      remote,
      new RecordingSparkClient,
      transportConf(3),
      executorAlive = _ => false)
    val l = new RecordingListener(false, 1)
    client.fetchBlocks("h", 1, "exec-2", Array("shuffle_0_1_0"), l, null)
    l.await()
    assertEquals(1, engine.requests.size())
    val e = l.failed.peek()._2
    assertTrue(s"not retryable: $e", e.isInstanceOf[org.apache.spark.ExecutorDeadException])
  }

  @Test def anExecutorTheDriverCannotVouchForIsRetriedAsBefore(): Unit = {
    // The driver unreachable (the question throws): Spark's retry policy decides, as before.
    val engine = new ScriptedEngine((call, _, cb) =>
      if (call == 1) cb.onFailure(0, "peer_gone", "reset") else cb.onBlock(0, bytesOf(2, 1), 11L))
    val client = new NativeBlockStoreClient(
      engine,
      remote,
      new RecordingSparkClient,
      transportConf(2),
      executorAlive = _ => throw new IllegalStateException("driver unreachable"))
    val l = new RecordingListener(false, 1)
    client.fetchBlocks("h", 1, "exec-2", Array("shuffle_0_1_0"), l, null)
    l.await()
    assertTrue(l.failed.isEmpty)
    assertEquals(2, engine.requests.size())
    assertEquals(0L, client.deadExecutorFailureCount)
  }

  /** Writes `bytesOf(n, seed)` into `file` as the engine's stream would, then reports it. */
  private def writeFile(file: File, n: Int, seed: Int, cb: FetchCallback): Unit = {
    val ch = java.nio.channels.FileChannel.open(
      file.toPath,
      java.nio.file.StandardOpenOption.WRITE,
      java.nio.file.StandardOpenOption.TRUNCATE_EXISTING)
    try ch.write(bytesOf(n, seed))
    finally ch.close()
    cb.onFile(0, n.toLong)
  }

  @Test def toDiskRequestsAreStreamedIntoTheFetchersFiles(): Unit = {
    // Issue 14: a request Spark wants on disk never passes through one native buffer per block:
    // each block is streamed into its own DownloadFileManager temp file; a failed stream's file
    // is deleted.
    val tc = transportConf(0)
    val dir = java.nio.file.Files.createTempDirectory("rdma-dl").toFile
    val registered = new ConcurrentLinkedQueue[DownloadFile]()
    val dfm = new DownloadFileManager {
      override def createTempFile(conf: TransportConf): DownloadFile =
        new SimpleDownloadFile(File.createTempFile("blk", ".tmp", dir), conf)
      override def registerTempFileToClean(file: DownloadFile): Boolean = registered.add(file)
    }
    val engine = new ScriptedEngine(
      (_, _, _) => fail("a to-disk request must not be fetched into memory"),
      (block, file, cb) =>
        if (block.mapId == 3L) cb.onFailure(0, "corrupt", "data file truncated")
        else writeFile(file, 100000 + block.startReduceId, block.startReduceId, cb)
    )
    val client = new NativeBlockStoreClient(engine, remote, new RecordingSparkClient, tc)
    val l = new RecordingListener(false, 3)
    client.fetchBlocks(
      "h",
      1,
      "exec-2",
      Array("shuffle_0_1_0", "shuffle_0_1_2_5", "shuffle_0_3_0"),
      l,
      dfm)
    l.await()
    val got = l.ok.asScala.toMap
    assertArrayEquals(bytes(bytesOf(100000, 0)), got("shuffle_0_1_0"))
    assertArrayEquals(bytes(bytesOf(100002, 2)), got("shuffle_0_1_2_5"))
    assertEquals(
      Seq(BlockRange(0, 1L, 0, 1), BlockRange(0, 1L, 2, 5), BlockRange(0, 3L, 0, 1)),
      engine.streamed.asScala.map(_._1).toSeq)
    val (failedId, e) = l.failed.peek()
    assertEquals("shuffle_0_3_0", failedId)
    assertTrue(e.getMessage, e.getMessage.contains("data file truncated"))
    assertFalse(
      "the failed stream's temp file is deleted",
      engine.streamed.asScala.last._2.exists())
    assertEquals(2, registered.size())
    registered.asScala.foreach(f => assertTrue(new File(f.path()).length() >= 100000))
    registered.asScala.foreach(_.delete())
    dir.delete()
  }

  @Test def blocksWithoutPoolMemoryAreStreamedIntoATempFileDeletedOnRelease(): Unit = {
    // A block fetched into memory that is larger than the pool cap streams into a block-manager
    // temp file instead; the file lives until Spark releases the buffer.
    val dir = java.nio.file.Files.createTempDirectory("rdma-tmp").toFile
    val engine = new ScriptedEngine(
      (_, _, cb) => cb.onFailure(0, "pool_exhausted", "no buffer for a 9000000-byte block"),
      (_, file, cb) => writeFile(file, 300000, 5, cb))
    val client = new NativeBlockStoreClient(
      engine,
      remote,
      new RecordingSparkClient,
      transportConf(0),
      () => File.createTempFile("temp_local_", ".tmp", dir))
    val l = new RecordingListener(retain = true, expected = 1)
    client.fetchBlocks("h", 1, "exec-2", Array("shuffle_0_1_0"), l, null)
    l.await()
    assertTrue(s"failures: ${l.failed.asScala}", l.failed.isEmpty)
    assertArrayEquals(bytes(bytesOf(300000, 5)), l.ok.peek()._2)
    val file = engine.streamed.peek()._2
    assertTrue("kept while Spark holds the buffer", file.exists())
    l.kept.asScala.foreach(_.release())
    assertFalse("deleted when Spark released it", file.exists())
    dir.delete()
  }

  // --- beside the external shuffle service (spark.shuffle.service.enabled) ---------------------

  /** A client beside the external shuffle service (`service` stands in for Spark's client). */
  private def serviceClient(
      engine: ShuffleEngine,
      service: BlockStoreClient,
      alive: String => Boolean): NativeBlockStoreClient =
    new NativeBlockStoreClient(
      engine,
      remote,
      service,
      transportConf(3),
      executorAlive = alive,
      shuffleService = true)

  @Test def withTheShuffleServiceWhatTheEngineCannotDeliverComesFromTheService(): Unit = {
    // A fetch in flight when its executor leaves (peer_gone, a refused connection, a silent
    // peer) and any other engine failure: the block comes from the service at the address
    // Spark placed the map output at (the executor's host, the service's port), once, without
    // the engine's retries; a block the engine delivered is not asked twice.
    val kinds = Seq("peer_gone", "connect", "timeout", "io", "corrupt", "pull_failed")
    val engine = new ScriptedEngine((_, _, cb) => {
      cb.onBlock(0, bytesOf(5, 7), 70L)
      kinds.zipWithIndex.foreach { case (k, i) => cb.onFailure(i + 1, k, s"$k happened") }
    })
    val service = new RecordingSparkClient(serve = true)
    val asked = new ConcurrentLinkedQueue[String]()
    val client = serviceClient(engine, service, id => { asked.add(id); false })
    val ids = (0 to kinds.size).map(i => s"shuffle_0_1_$i").toArray
    val l = new RecordingListener(false, ids.length)
    client.fetchBlocks("nodeA", 7337, "exec-2", ids, l, null)
    l.await()
    assertTrue(s"failures: ${l.failed.asScala}", l.failed.isEmpty)
    val got = l.ok.asScala.map { case (id, b) => (id, b.toSeq) }.toMap
    assertEquals(bytes(bytesOf(5, 7)).toSeq, got("shuffle_0_1_0"))
    ids.tail.foreach(id => assertEquals(id.getBytes.toSeq, got(id)))
    assertEquals("one engine attempt, no retries", 1, engine.requests.size())
    assertEquals(
      ids.tail.map(id => ("nodeA", 7337, "exec-2", Seq(id))).toSet,
      service.calls.asScala.toSet)
    assertEquals(kinds.size.toLong, client.serviceFallbackCount)
    assertEquals(Seq(70L), engine.released.asScala.toSeq)
    // The driver said the executor is gone: its next request goes straight to the service.
    assertTrue("the driver was asked", asked.asScala.toSet == Set("exec-2"))
    assertEquals(1, client.departedExecutorCount)
    val l2 = new RecordingListener(false, 1)
    client.fetchBlocks("nodeA", 7337, "exec-2", Array("shuffle_0_2_0"), l2, null)
    l2.await()
    assertEquals(1, engine.requests.size())
    assertEquals("shuffle_0_2_0".getBytes.toSeq, l2.ok.peek()._2.toSeq)
    assertEquals(1L, client.delegatedRequestCount)
  }

  @Test def withTheShuffleServiceALiveExecutorKeepsItsEngine(): Unit = {
    // A failure towards an executor the driver still counts alive: that block comes from the
    // service, and the executor's next request goes to its engine again.
    val engine = new ScriptedEngine((call, _, cb) =>
      if (call == 1) cb.onFailure(0, "peer_gone", "reset") else cb.onBlock(0, bytesOf(3, 2), 5L))
    val service = new RecordingSparkClient(serve = true)
    val client = serviceClient(engine, service, _ => true)
    for (i <- 0 to 1) {
      val l = new RecordingListener(false, 1)
      client.fetchBlocks("nodeA", 7337, "exec-2", Array(s"shuffle_0_1_$i"), l, null)
      l.await()
      assertTrue(l.failed.isEmpty)
    }
    assertEquals(2, engine.requests.size())
    assertEquals(1, service.calls.size())
    assertEquals(0, client.departedExecutorCount)
  }

  @Test def withTheShuffleServiceAFetchThatCannotStartGoesToTheService(): Unit = {
    val engine = new ScriptedEngine((_, _, _) =>
      throw new RdmaShuffleException("connect", "connection refused"))
    val service = new RecordingSparkClient(serve = true)
    val client = serviceClient(
      engine,
      service,
      _ => { fail("not asked when the request could not start"); true })
    val l = new RecordingListener(false, 2)
    client.fetchBlocks("nodeA", 7337, "exec-2", Array("shuffle_0_1_0", "shuffle_0_1_1"), l, null)
    l.await()
    assertTrue(l.failed.isEmpty)
    assertEquals(2L, client.serviceFallbackCount)
    assertEquals(1, engine.requests.size())
  }

  @Test def withTheShuffleServiceSparkSeesTheServicesOwnFailure(): Unit = {
    // Both failed: Spark's fetcher gets the service's error as it is (it treats some kinds
    // specially), and decides on FetchFailed as it would without the plugin.
    val serviceError = new IOException("Connection refused: nodeA/7337")
    val engine = new ScriptedEngine((_, _, cb) => cb.onFailure(0, "peer_gone", "reset"))
    val service =
      new RecordingSparkClient(serve = true, failing = Set("shuffle_0_1_0"), failure = serviceError)
    val client = serviceClient(engine, service, _ => false)
    val l = new RecordingListener(false, 1)
    client.fetchBlocks("nodeA", 7337, "exec-2", Array("shuffle_0_1_0"), l, null)
    l.await()
    assertSame(serviceError, l.failed.peek()._2)
    assertEquals(1, engine.requests.size())
  }
}
