/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.File
import java.nio.ByteBuffer
import java.util.concurrent.TimeUnit
import java.util.concurrent.atomic.AtomicLong
import java.util.concurrent.locks.ReentrantReadWriteLock

import org.apache.spark.internal.Logging

/**
 * The native engine behind a `jlong` handle.
 *
 * The handle must never reach native code after `engineClose`: every call holds the read side
 * of a lock and checks `open`; `close()` takes the write side only to clear `open` (waiting for
 * calls already inside native code), and calls `engineClose` after releasing it. It must not
 * hold the lock while the engine shuts down: shutdown fails the fetches in flight and joins the
 * delivery thread, whose callbacks may call back into this engine (a retry, a release); with the
 * write lock held those callbacks waited for the read lock forever (issue 14, bug 3). Now they
 * see a closed engine and get `RdmaShuffleException("closed")`.
 *
 * Leases need no lock: a lease handle is a key into the native lease table, and a lease keeps
 * its pool memory alive after the engine closed, so a buffer Spark still holds stays valid and
 * its release after close gives the memory back (a stale or repeated release is a no-op).
 */
final class NativeEngine private (handle: Long) extends ShuffleEngine with Logging {
  private val lock = new ReentrantReadWriteLock()
  @volatile private var open = true
  private val outstandingLeases = new AtomicLong()

  private def guarded[T](what: String)(body: => T): T = {
    lock.readLock().lock()
    try {
      if (!open) {
        throw new RdmaShuffleException("closed", s"native shuffle engine already closed ($what)")
      }
      body
    } finally {
      lock.readLock().unlock()
    }
  }

  override lazy val port: Int = guarded("enginePort")(NativeBridge.enginePort(handle))

  override lazy val transport: String =
    guarded("engineTransport")(NativeBridge.engineTransport(handle))

  override lazy val transportReason: String =
    guarded("engineTransportReason")(NativeBridge.engineTransportReason(handle))

  override def registerMapOutput(
      shuffleId: Int,
      mapId: Long,
      dataFile: File,
      indexFile: File,
      numPartitions: Int): Unit = guarded("registerMapOutput") {
    NativeBridge.registerMapOutput(
      handle,
      shuffleId,
      mapId,
      dataFile.getAbsolutePath,
      indexFile.getAbsolutePath,
      numPartitions)
  }

  override def unregisterShuffle(shuffleId: Int): Int =
    guarded("unregisterShuffle")(NativeBridge.unregisterShuffle(handle, shuffleId))

  override def fetchBlocks(
      host: String,
      port: Int,
      blocks: IndexedSeq[BlockRange],
      callback: FetchCallback): Unit = guarded("fetchBlocks") {
    val n = blocks.length
    val shuffleIds = new Array[Int](n)
    val mapIds = new Array[Long](n)
    val starts = new Array[Int](n)
    val ends = new Array[Int](n)
    var i = 0
    while (i < n) {
      val b = blocks(i)
      shuffleIds(i) = b.shuffleId
      mapIds(i) = b.mapId
      starts(i) = b.startReduceId
      ends(i) = b.endReduceId
      i += 1
    }
    // Count a lease as soon as the engine hands it out, before any JVM code can release it.
    val counting = new FetchCallback {
      override def onBlock(index: Int, directBuf: ByteBuffer, leaseHandle: Long): Unit = {
        outstandingLeases.incrementAndGet()
        callback.onBlock(index, directBuf, leaseHandle)
      }
      override def onFailure(index: Int, kind: String, message: String): Unit =
        callback.onFailure(index, kind, message)
    }
    NativeBridge.fetchBlocks(handle, host, port, shuffleIds, mapIds, starts, ends, counting)
  }

  override def fetchBlockToFile(
      host: String,
      port: Int,
      block: BlockRange,
      file: java.io.File,
      callback: FetchCallback): Unit = guarded("fetchBlockToFile") {
    NativeBridge.fetchBlockToFile(
      handle,
      host,
      port,
      block.shuffleId,
      block.mapId,
      block.startReduceId,
      block.endReduceId,
      file.getAbsolutePath,
      callback)
  }

  override def releaseLease(lease: Long): Unit = {
    // No lock and no `open` check: valid before and after close (see the class docs).
    if (NativeBridge.releaseLease(lease)) outstandingLeases.decrementAndGet()
  }

  override def stats: Seq[(String, String)] = guarded("engineStats") {
    NativeEngine.parseLines(NativeBridge.engineStats(handle))
  }

  /** Number of leases handed out and not yet released. */
  def leasesOutstanding: Long = outstandingLeases.get()

  override def close(): Unit = {
    val deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(NativeEngine.CloseGraceSeconds)
    // Spark releases fetched buffers when a task completes; stop() comes after the last task,
    // so this normally passes at once. Bounded: stop() must not hang executor shutdown, and a
    // buffer still held after close stays valid (its lease keeps the memory).
    while (outstandingLeases.get() > 0 && System.nanoTime() < deadline) {
      Thread.sleep(10)
    }
    lock.writeLock().lock()
    val wasOpen =
      try {
        val w = open
        open = false
        w
      } finally {
        lock.writeLock().unlock()
      }
    if (wasOpen) {
      val left = outstandingLeases.get()
      if (left > 0) {
        logWarning(s"Closing the native shuffle engine with $left fetched block buffer(s) " +
          s"still held after ${NativeEngine.CloseGraceSeconds}s; their memory is freed when " +
          "they are released.")
      }
      // Outside the lock: callbacks run during shutdown may call this engine (see class docs).
      NativeBridge.engineClose(handle)
    }
  }
}

/** Opening engines. */
object NativeEngine {

  /** How long `close()` waits for outstanding leases. */
  val CloseGraceSeconds = 5

  /**
   * Opens a native engine. The library must be loaded ([[NativeLoader.load]]).
   *
   * @param config `key=value` lines (see [[RdmaShuffleConf.engineConfig]])
   * @throws RdmaShuffleException when the engine cannot start
   */
  def open(config: String): NativeEngine = {
    val h = NativeBridge.engineOpen(config)
    if (h == 0L) {
      throw new RdmaShuffleException("internal", "engineOpen returned a null handle")
    }
    new NativeEngine(h)
  }

  /** Parses `key=value` lines; blank lines and lines without '=' are ignored. */
  def parseLines(text: String): Seq[(String, String)] =
    Option(text).toSeq.flatMap(_.split("\n")).map(_.trim).filter(_.contains("=")).map { l =>
      val i = l.indexOf('=')
      (l.substring(0, i).trim, l.substring(i + 1).trim)
    }
}
