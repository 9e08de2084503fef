/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.{File, IOException}
import java.nio.ByteBuffer
import java.util.concurrent.{
  CompletableFuture,
  ConcurrentHashMap,
  ExecutorService,
  LinkedBlockingQueue,
  ThreadFactory,
  ThreadPoolExecutor,
  TimeUnit
}
import java.util.concurrent.atomic.{AtomicInteger, AtomicIntegerArray, AtomicLong}

import scala.util.control.NonFatal

import org.apache.spark.{ExecutorDeadException, SparkEnv}
import org.apache.spark.internal.Logging
import org.apache.spark.network.buffer.{FileSegmentManagedBuffer, ManagedBuffer}
import org.apache.spark.network.shuffle.{
  BlockFetchingListener,
  BlockStoreClient,
  BlockTransferListener,
  DownloadFileManager,
  RetryingBlockTransferor
}
import org.apache.spark.network.shuffle.checksum.Cause
import org.apache.spark.network.util.TransportConf
import org.apache.spark.storage.{BlockId, BlockManagerMessages, ShuffleBlockBatchId, ShuffleBlockId}

/** Where a remote executor's engine listens. */
final case class EngineAddress(host: String, port: Int)

/** Resolves an executor id to its engine's address; `None` when that executor has no engine. */
trait EngineDirectory {

  /** The engine of `executorId`, if it registered one. */
  def lookup(executorId: String): Option[EngineAddress]
}

/**
 * The [[BlockStoreClient]] that Spark's own `ShuffleBlockFetcherIterator` fetches remote shuffle
 * blocks through (see [[RdmaShuffleReader]]): Spark keeps bytes-in-flight limits, corruption
 * detection, `FetchFailedException` and metrics; this class only moves the bytes.
 *
 * A request goes to the native engine when every block id is a plain or batch shuffle block id
 * and the remote executor registered an engine; anything else (push-merged chunks, executors
 * whose native library did not load, ...) goes to Spark's own client unchanged. Native fetches
 * are wrapped in Spark's `RetryingBlockTransferor`, so `spark.shuffle.io.maxRetries` and
 * `spark.shuffle.io.retryWait` apply exactly as with Netty; transient engine errors therefore
 * reach it as `IOException`s — except a timeout (the peer was silent for the whole
 * `fetchTimeout`/`connectTimeout`; a retry would wait as long again), and unless the driver
 * reports the serving executor dead: as in
 * Spark's own client (SPARK-27637), a transient failure towards an executor the driver has
 * removed fails at once with `ExecutorDeadException`, which is never retried, so the reducer
 * reports `FetchFailed` without waiting `maxRetries` x `retryWait` for a peer that is gone.
 *
 * A block the remote engine does not have (`unknown_map_output`, `unknown_shuffle`: its map
 * output's registration failed on that executor, or a reducer asked for a migrated output in
 * the moment between its arrival and its registration) is fetched again through Spark's own
 * client from the same executor, whose block manager serves every committed map output from
 * Spark's files. Only if that fails too
 * does Spark see a failure (and, after its retries, `FetchFailedException`).
 *
 * Requests the fetcher wants on disk (larger than `spark.network.maxRemoteBlockSizeFetchToMem`:
 * Spark then passes a `DownloadFileManager`) are streamed block by block into the fetcher's temp
 * files, as Spark's own client does: the engine pulls each block in ranges of at most the largest
 * pool tier, two at a time, and writes them to the file, so a block larger than the pool cap or
 * than 2 GiB never needs one buffer of its size. Spark gets a `FileSegmentManagedBuffer` and
 * deletes the file when the fetcher is cleaned up. A block fetched into memory that finds no
 * pool memory (`pool_exhausted`: larger than `spark.shuffle.rdma.pool.capBytes`, or the pool is
 * full) is streamed the same way into a temp file of the block manager, deleted when Spark
 * releases the buffer. Offsets and lengths are longs throughout.
 *
 * '''Beside the external shuffle service''' (`shuffleService`: `spark.shuffle.service.enabled`).
 * Spark then places every map output at its executor's host and the service's port, and
 * `sparkClient` is Spark's `ExternalBlockStoreClient`, which fetches from the service; the
 * executors registered their local directories with the service, as Spark does, so it serves
 * the same files the engines serve. A request still goes to the serving executor's engine while
 * that executor lives, once, without Spark's retries; a block the engine cannot deliver, for any
 * reason, is fetched from the service instead (with the service client's own retries), and only
 * the service's failure reaches Spark. That includes a fetch in flight when its executor leaves
 * (released by dynamic allocation, or killed): it fails with `peer_gone`, `connect` or `timeout`
 * and the reducer gets the block from the service, as it would have without the plugin, instead
 * of a `FetchFailed` that would make Spark recompute an output the service still has. An
 * executor the driver reports gone is remembered, and later requests for its blocks go straight
 * to the service.
 *
 * @param engine the local engine (its client half)
 * @param directory executor id -> engine address
 * @param sparkClient Spark's own client (`blockManager.blockStoreClient`), not owned here
 * @param transportConf Spark's shuffle transport conf (retries, temp-file buffers)
 * @param tempFile a new temp file for a block streamed outside a `DownloadFileManager` (default:
 *     the block manager's `createTempLocalBlock`)
 * @param executorAlive whether the driver still counts an executor alive (asked after a
 *   transient failure; `true` when it cannot be asked)
 * @param shuffleService whether Spark's external shuffle service serves the map outputs too
 *   (`sparkClient` then fetches from it; see above)
 */
class NativeBlockStoreClient(
    engine: ShuffleEngine,
    directory: EngineDirectory,
    sparkClient: BlockStoreClient,
    transportConf: TransportConf,
    tempFile: () => File = NativeBlockStoreClient.blockManagerTempFile,
    executorAlive: String => Boolean = NativeBlockStoreClient.askDriverIfAlive,
    shuffleService: Boolean = false)
  extends BlockStoreClient with Logging {

  private val nativeRequests = new AtomicLong()
  private val delegatedRequests = new AtomicLong()
  private val unknownToEngine = new AtomicLong()

  /** Requests sent through the native engine so far. */
  def nativeRequestCount: Long = nativeRequests.get()

  /** Requests handed to Spark's own client so far. */
  def delegatedRequestCount: Long = delegatedRequests.get()

  /** Blocks a remote engine did not have, fetched again through Spark's own client. */
  def unknownToEngineCount: Long = unknownToEngine.get()

  /** Transient failures not retried because the driver reported the executor dead. */
  def deadExecutorFailureCount: Long = deadExecutorFailures.get()

  private val deadExecutorFailures = new AtomicLong()

  private val serviceFallbacks = new AtomicLong()

  /** Blocks the engine did not deliver that were fetched from the external shuffle service. */
  def serviceFallbackCount: Long = serviceFallbacks.get()

  /**
   * Executors the driver reported gone after a failed engine fetch, with the external shuffle
   * service on: their blocks go straight to the service (an executor id is never reused).
   */
  private val departed = ConcurrentHashMap.newKeySet[String]()

  /** Executors whose blocks now go straight to the external shuffle service. */
  def departedExecutorCount: Int = departed.size()

  /** The driver's answer; blocks on an RPC to it, so never on an engine thread. */
  private def aliveNow(execId: String): Boolean =
    try executorAlive(execId)
    catch { case NonFatal(_) => true }

  /**
   * What a transient failure towards `execId` becomes: `ExecutorDeadException` (not retried)
   * when the driver has removed that executor, else an `IOException` (retried by Spark's
   * policy).
   */
  private def transientError(
      execId: String,
      alive: Boolean,
      message: String,
      cause: Throwable): Throwable = {
    if (alive) {
      new IOException(message, cause)
    } else {
      deadExecutorFailures.incrementAndGet()
      // Spark's own ExecutorDeadException carries no cause (its constructor sets null, so
      // initCause would throw): the engine's failure kind goes into the message.
      val kind = cause match {
        case r: RdmaShuffleException => s" [${r.kind()}]"
        case _ => ""
      }
      new ExecutorDeadException(
        s"$message$kind; the driver reports executor $execId dead, so the fetch is not retried")
    }
  }

  override def fetchBlocks(
      host: String,
      port: Int,
      execId: String,
      blockIds: Array[String],
      listener: BlockFetchingListener,
      downloadFileManager: DownloadFileManager): Unit = {
    val ranges = NativeBlockStoreClient.toRanges(blockIds)
    val target =
      if (ranges.isDefined && !departed.contains(execId)) directory.lookup(execId) else None
    (ranges, target) match {
      case (Some(_), Some(addr)) =>
        nativeRequests.incrementAndGet()
        val starter = new RetryingBlockTransferor.BlockTransferStarter {
          override def createAndStart(ids: Array[String], l: BlockTransferListener): Unit =
            startNative(addr, host, port, execId, ids, l, downloadFileManager)
        }
        if (shuffleService) {
          // One engine attempt; what it cannot deliver goes to the service, which retries.
          try starter.createAndStart(blockIds, listener)
          catch {
            case NonFatal(e) =>
              val why = e match {
                case r: RdmaShuffleException => s"[${r.kind()}] ${r.getMessage}"
                case other => other.toString
              }
              blockIds.foreach(id =>
                serviceFetch(host, port, execId, id, listener, downloadFileManager, why))
          }
        } else if (transportConf.maxIORetries() > 0) {
          new RetryingBlockTransferor(transportConf, starter, blockIds, listener).start()
        } else {
          starter.createAndStart(blockIds, listener)
        }
      case _ =>
        delegatedRequests.incrementAndGet()
        sparkClient.fetchBlocks(host, port, execId, blockIds, listener, downloadFileManager)
    }
  }

  private def startNative(
      addr: EngineAddress,
      sparkHost: String,
      sparkPort: Int,
      execId: String,
      ids: Array[String],
      listener: BlockTransferListener,
      downloadFileManager: DownloadFileManager): Unit = {
    // ids passed by a retry are a subset of the original request, all valid shuffle ids.
    val ranges = NativeBlockStoreClient.toRanges(ids).getOrElse(
      throw new IllegalArgumentException(s"not shuffle block ids: ${ids.mkString(",")}"))
    val callback =
      new ListenerCallback(addr, sparkHost, sparkPort, execId, ids, listener, downloadFileManager)
    try {
      if (downloadFileManager != null) {
        ranges.indices.foreach(callback.streamToDownloadFile)
      } else {
        engine.fetchBlocks(addr.host, addr.port, ranges, callback)
      }
    } catch {
      case e: RdmaShuffleException if e.isTransient && !shuffleService =>
        // On the task's or Spark's retry thread: asking the driver here is what Spark does.
        throw transientError(
          execId,
          aliveNow(execId),
          s"fetch of ${ids.length} block(s) from executor $execId engine " +
            s"${addr.host}:${addr.port} failed to start: ${e.getMessage}",
          e
        )
    }
  }

  /** Maps the engine's per-index callbacks onto Spark's listener, exactly once per index. */
  private final class ListenerCallback(
      addr: EngineAddress,
      sparkHost: String,
      sparkPort: Int,
      execId: String,
      ids: Array[String],
      listener: BlockTransferListener,
      downloadFileManager: DownloadFileManager) extends FetchCallback {

    private val done = new AtomicIntegerArray(ids.length)

    /** One driver query per request, however many of its blocks fail. */
    private lazy val peerAlive: Boolean = aliveNow(execId)

    private def claim(index: Int): Boolean =
      index >= 0 && index < ids.length && done.compareAndSet(index, 0, 1)

    // Spark's RetryingBlockTransferor hands us a listener that accepts only the fetch-specific
    // callbacks (it rejects the generic onBlockTransfer* ones), so dispatch on the type.
    private def success(blockId: String, buf: org.apache.spark.network.buffer.ManagedBuffer): Unit =
      listener match {
        case f: BlockFetchingListener => f.onBlockFetchSuccess(blockId, buf)
        case other => other.onBlockTransferSuccess(blockId, buf)
      }

    private def failure(blockId: String, e: Throwable): Unit = {
      // A listener that throws here would otherwise leave the fetcher waiting for this block
      // forever (we are on an engine thread; nobody else will report it).
      try {
        listener match {
          case f: BlockFetchingListener => f.onBlockFetchFailure(blockId, e)
          case other => other.onBlockTransferFailure(blockId, e)
        }
      } catch {
        case NonFatal(t) =>
          logError(s"Fetch listener failed while reporting failure of $blockId", t)
      }
    }

    private def deliver(
        blockId: String,
        buf: org.apache.spark.network.buffer.ManagedBuffer): Unit = {
      try {
        success(blockId, buf)
      } catch {
        case NonFatal(t) =>
          logError(s"Fetch listener failed to accept block $blockId", t)
          failure(blockId, t)
      }
    }

    override def onBlock(index: Int, directBuf: ByteBuffer, leaseHandle: Long): Unit = {
      val buf = new NativeManagedBuffer(directBuf, leaseHandle, engine.releaseLease)
      if (!claim(index)) {
        // A second result for one index (or an index out of range) is an engine bug; never let
        // it leak pool memory or reach Spark twice.
        logWarning(s"Ignoring unexpected block result for index $index of ${ids.length} from " +
          s"executor $execId engine ${addr.host}:${addr.port}")
        buf.release()
      } else {
        // In memory (a request Spark wants on disk is streamed to files instead).
        try {
          deliver(ids(index), buf)
        } finally {
          buf.release() // the listener retained what it keeps
        }
      }
    }

    /** The block through Spark's own client; its outcome goes to the same listener. */
    private def viaSpark(blockId: String, kind: String, message: String): Unit = {
      if (unknownToEngine.incrementAndGet() == 1) {
        logInfo(s"Executor $execId's engine does not have $blockId ([$kind] $message); " +
          "fetching it, and any such block later, through Spark's block transfer service")
      }
      // Never Spark's retrying listener itself: Spark's client wraps what it gets in a
      // retrying transferor of its own, whose calls (getTransferType, onBlockTransfer*) the
      // outer retrying listener rejects. A plain fetching listener forwards the outcome.
      val fetching = new BlockFetchingListener {
        override def onBlockFetchSuccess(id: String, b: ManagedBuffer): Unit = deliver(id, b)
        override def onBlockFetchFailure(id: String, e: Throwable): Unit = failure(id, e)
      }
      try {
        sparkClient.fetchBlocks(
          sparkHost,
          sparkPort,
          execId,
          Array(blockId),
          fetching,
          downloadFileManager)
      } catch {
        case NonFatal(e) => failure(blockId, e)
      }
    }

    /**
     * Streams block `index` into a temp file of the fetcher's `DownloadFileManager` and hands
     * Spark the file once complete.
     */
    def streamToDownloadFile(index: Int): Unit = {
      val file = downloadFileManager.createTempFile(transportConf)
      stream(index, new File(file.path()), () => file.delete()) { length =>
        if (downloadFileManager.registerTempFileToClean(file)) {
          deliver(
            ids(index),
            new FileSegmentManagedBuffer(transportConf, new File(file.path()), 0, length))
        } else {
          // The fetcher is already cleaned up (task finished or failed): nobody wants it.
          file.delete()
        }
      }
    }

    /** Streams block `index` into `target`; `complete` gets its length, after `claim`. */
    private def stream(
        index: Int,
        target: File,
        delete: () => Unit)(complete: Long => Unit): Unit = {
      val cb = new FetchCallback {
        override def onBlock(i: Int, directBuf: ByteBuffer, leaseHandle: Long): Unit = {
          engine.releaseLease(leaseHandle)
          delete()
          ListenerCallback.this.onFailure(
            index,
            "protocol",
            "a buffer came back for a streamed block")
        }
        override def onFailure(i: Int, kind: String, message: String): Unit = {
          delete()
          // Not again to a temp file: the stream itself failed.
          ListenerCallback.this.fail(index, kind, s"streaming into $target: $message")
        }
        override def onFile(i: Int, length: Long): Unit =
          if (claim(index)) {
            try complete(length)
            catch { case NonFatal(e) => delete(); failure(ids(index), e) }
          } else {
            delete()
            logWarning(s"Ignoring a second result for streamed block ${ids(index)}")
          }
      }
      engine.fetchBlockToFile(addr.host, addr.port, ranges(index), target, cb)
    }

    private lazy val ranges = NativeBlockStoreClient.toRanges(ids).get

    override def onFailure(index: Int, kind: String, message: String): Unit = {
      if (kind == "pool_exhausted" && downloadFileManager == null && index >= 0 &&
        index < ids.length && done.get(index) == 0) {
        // No pool memory for the whole block: stream it into a temp file instead.
        var target: File = null
        try {
          target = tempFile()
          logInfo(s"Streaming ${ids(index)} from executor $execId into $target: $message")
          val file = target
          stream(index, file, () => file.delete()) { length =>
            val buf = new NativeBlockStoreClient.TempFileBuffer(transportConf, file, length)
            try deliver(ids(index), buf)
            finally buf.release() // the listener retained what it keeps
          }
        } catch {
          case NonFatal(e) =>
            if (target != null) target.delete()
            fail(index, kind, s"$message; streaming it into a temp file failed to start: $e")
        }
      } else {
        fail(index, kind, message)
      }
    }

    private def fail(index: Int, kind: String, message: String): Unit = {
      if (claim(index)) {
        val blockId = ids(index)
        if (NativeBlockStoreClient.UnknownToEngine.contains(kind)) {
          viaSpark(blockId, kind, message)
        } else if (shuffleService) {
          val why =
            s"[$kind] fetch of $blockId from executor $execId engine ${addr.host}:${addr.port}: " +
              message
          // Off the engine's delivery thread: the service client connects synchronously, and
          // the liveness question is an RPC to the driver.
          NativeBlockStoreClient.failureReporters.execute(new Runnable {
            override def run(): Unit = {
              if (NativeBlockStoreClient.PeerMayBeGone.contains(kind) && !peerAlive &&
                departed.add(execId)) {
                logInfo(s"Executor $execId is gone (the driver says so after $why); its " +
                  "blocks are fetched from the external shuffle service from now on")
              }
              serviceFetch(
                sparkHost,
                sparkPort,
                execId,
                blockId,
                listener,
                downloadFileManager,
                why)
            }
          })
        } else {
          val what = s"fetch of $blockId from executor $execId engine ${addr.host}:${addr.port}"
          if (kind == NativeBlockStoreClient.TimeoutKind) {
            // The peer was silent for the whole fetch (or connect) timeout: a retry would
            // wait that long again, holding the task slot maxRetries times over, so Spark gets
            // a FetchFailed now (issue 14: FetchFailed within spark.shuffle.rdma.fetchTimeout).
            failure(
              blockId,
              new RdmaShuffleException(kind, s"$what: $message (not retried: a timeout is final)"))
            return
          }
          val cause = new RdmaShuffleException(kind, s"$what: $message")
          if (cause.isTransient) {
            // Off the engine's delivery thread: the liveness question is an RPC to the driver.
            NativeBlockStoreClient.failureReporters.execute(new Runnable {
              override def run(): Unit =
                failure(blockId, transientError(execId, peerAlive, cause.getMessage, cause))
            })
          } else {
            failure(blockId, cause)
          }
        }
      } else {
        logWarning(s"Ignoring unexpected failure for index $index of ${ids.length} from " +
          s"executor $execId engine ${addr.host}:${addr.port}: [$kind] $message")
      }
    }
  }

  /**
   * Fetches `blockId` from the external shuffle service at `host:port` (where Spark placed the
   * map output) after the engine could not deliver it (`why`); the outcome goes to `listener`.
   * Spark's service client retries by its own policy; its failure is the one Spark sees.
   */
  private def serviceFetch(
      host: String,
      port: Int,
      execId: String,
      blockId: String,
      listener: BlockTransferListener,
      downloadFileManager: DownloadFileManager,
      why: String): Unit = {
    if (serviceFallbacks.incrementAndGet() == 1) {
      logInfo(s"Fetching $blockId of executor $execId from the external shuffle service at " +
        s"$host:$port: the engine did not deliver it ($why). Later such blocks are counted in " +
        "service_fallback_blocks.")
    }
    val forward = new BlockFetchingListener {
      override def onBlockFetchSuccess(id: String, b: ManagedBuffer): Unit = listener match {
        case f: BlockFetchingListener => f.onBlockFetchSuccess(id, b)
        case other => other.onBlockTransferSuccess(id, b)
      }
      override def onBlockFetchFailure(id: String, e: Throwable): Unit = {
        // Spark gets the service's own error, as without the plugin (its fetcher treats some
        // kinds specially); the engine's part is logged.
        logWarning(s"$id of executor $execId: the external shuffle service at $host:$port " +
          s"failed too, after the engine ($why)")
        try {
          listener match {
            case f: BlockFetchingListener => f.onBlockFetchFailure(id, e)
            case other => other.onBlockTransferFailure(id, e)
          }
        } catch {
          case NonFatal(t) => logError(s"Fetch listener failed while reporting failure of $id", t)
        }
      }
    }
    try sparkClient.fetchBlocks(host, port, execId, Array(blockId), forward, downloadFileManager)
    catch { case NonFatal(e) => forward.onBlockFetchFailure(blockId, e) }
  }

  override def diagnoseCorruption(
      host: String,
      port: Int,
      execId: String,
      shuffleId: Int,
      mapId: Long,
      reduceId: Int,
      checksum: Long,
      algorithm: String): Cause =
    sparkClient.diagnoseCorruption(
      host,
      port,
      execId,
      shuffleId,
      mapId,
      reduceId,
      checksum,
      algorithm)

  override def getHostLocalDirs(
      host: String,
      port: Int,
      execIds: Array[String],
      hostLocalDirsCompletable: CompletableFuture[java.util.Map[String, Array[String]]]): Unit =
    sparkClient.getHostLocalDirs(host, port, execIds, hostLocalDirsCompletable)

  override def setAppAttemptId(appAttemptId: String): Unit =
    sparkClient.setAppAttemptId(appAttemptId)

  override def getAppAttemptId: String = sparkClient.getAppAttemptId

  /** Spark's client belongs to the BlockManager and the engine to the manager: nothing to do. */
  override def close(): Unit = ()
}

/** Block-id mapping and the shared disk-writer pool. */
object NativeBlockStoreClient {

  /**
   * Failure kinds meaning "this engine does not have the block": fetched again through Spark's
   * own client (see the class docs).
   */
  val UnknownToEngine: Set[String] = Set("unknown_map_output", "unknown_shuffle")

  /**
   * Failure kinds after which the serving executor may be gone (the driver is asked, with the
   * external shuffle service on, before its blocks go straight to the service).
   */
  val PeerMayBeGone: Set[String] = Set("connect", "closed", "peer_gone", "timeout", "io")

  /**
   * The failure kind of a peer that stayed silent past `spark.shuffle.rdma.fetchTimeout` (or
   * `connectTimeout`): reported to Spark without retries, so the reducer's FetchFailed comes
   * within that timeout.
   */
  val TimeoutKind = "timeout"

  /**
   * Maps Spark block id strings to engine block ranges: `shuffle_S_M_R` -> [R, R+1),
   * `shuffle_S_M_R1_R2` (a batch) -> [R1, R2). `None` when any id is of another kind.
   */
  def toRanges(blockIds: Array[String]): Option[IndexedSeq[BlockRange]] = {
    val out = new Array[BlockRange](blockIds.length)
    var i = 0
    while (i < blockIds.length) {
      val parsed =
        try BlockId(blockIds(i))
        catch { case NonFatal(_) => null }
      parsed match {
        case ShuffleBlockId(s, m, r) => out(i) = BlockRange(s, m, r, r + 1)
        case ShuffleBlockBatchId(s, m, r1, r2) => out(i) = BlockRange(s, m, r1, r2)
        case _ => return None
      }
      i += 1
    }
    Some(out.toIndexedSeq)
  }

  /** A new temp file of this executor's block manager (Spark's own temp-block naming). */
  def blockManagerTempFile(): File =
    SparkEnv.get.blockManager.diskBlockManager.createTempLocalBlock()._2

  /**
   * A streamed block in a temp file no `DownloadFileManager` owns, reference counted like a
   * pooled buffer (one reference at creation): the file is deleted when the last is released.
   * Spark's fetcher retains what it keeps and releases every result it took, read or not.
   */
  private[rdma] final class TempFileBuffer(conf: TransportConf, file: File, length: Long)
    extends ManagedBuffer {
    private val segment = new FileSegmentManagedBuffer(conf, file, 0, length)
    private val refs = new AtomicInteger(1)
    override def size(): Long = length
    override def nioByteBuffer(): ByteBuffer = segment.nioByteBuffer()
    override def createInputStream(): java.io.InputStream = segment.createInputStream()
    override def retain(): ManagedBuffer = {
      refs.incrementAndGet()
      this
    }
    override def release(): ManagedBuffer = {
      if (refs.decrementAndGet() == 0) file.delete()
      this
    }
    override def convertToNetty(): AnyRef = segment.convertToNetty()
    // Spark 4 only (no `override`, so Spark 3.5 builds too): a local temp file is never sent.
    def convertToNettyForSsl(): AnyRef =
      throw new UnsupportedOperationException(s"$file is a local temp file, never sent")
    override def toString: String = s"TempFileBuffer($file, $length bytes)"
  }

  /**
   * Whether the driver's block manager master still counts `execId` alive (the question
   * Spark's NettyBlockTransferService asks before it retries, SPARK-27637). `true` outside an
   * executor (no SparkEnv) or when the driver cannot answer: then Spark's retries decide.
   */
  def askDriverIfAlive(execId: String): Boolean = {
    val env = SparkEnv.get
    if (env == null || env.blockManager == null) true
    else
      env.blockManager.master.driverEndpoint
        .askSync[Boolean](BlockManagerMessages.IsExecutorAlive(execId))
  }

  private val threadCounter = new AtomicInteger()

  private def daemonThreads(prefix: String): ThreadFactory = new ThreadFactory {
    override def newThread(r: Runnable): Thread = {
      val t = new Thread(r, s"$prefix-${threadCounter.incrementAndGet()}")
      t.setDaemon(true)
      t
    }
  }

  /**
   * Reports transient failures off the engine's delivery thread (each may wait for the
   * driver's answer): two daemon threads at most, dying after 60 s idle, so an idle executor
   * keeps none.
   */
  private[rdma] lazy val failureReporters: ExecutorService = {
    val pool = new ThreadPoolExecutor(
      2,
      2,
      60L,
      TimeUnit.SECONDS,
      new LinkedBlockingQueue[Runnable](),
      daemonThreads("rdma-shuffle-failure-reporter"))
    pool.allowCoreThreadTimeOut(true)
    pool
  }
}
