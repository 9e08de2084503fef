/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.{DataInputStream, File, FileInputStream, RandomAccessFile}
import java.nio.ByteBuffer
import java.util.concurrent.{ConcurrentHashMap, Executors, TimeUnit}
import java.util.concurrent.atomic.{AtomicInteger, AtomicLong}

/**
 * An in-JVM [[ShuffleEngine]] for tests: serves registered map outputs by reading Spark's
 * `.data`/`.index` files, answers fetches from its own thread (as the native engine answers
 * from native threads) with direct buffers, and accounts for every lease. Failures can be
 * injected per block.
 *
 * @param failure decides, per block and attempt number (1-based, per block), whether to fail
 *                it and with which (kind, message)
 * @param refuseRegistration decides, per (shuffle, map), whether `registerMapOutput` throws
 *                           (as the native engine does when it cannot register the files)
 */
class LoopbackEngine(
    val failure: (BlockRange, Int) => Option[(String, String)] = (_, _) => None,
    val refuseRegistration: (Int, Long) => Boolean = (_, _) => false)
  extends ShuffleEngine {

  private val outputs = new ConcurrentHashMap[(Int, Long), (File, File, Int)]()
  private val attempts = new ConcurrentHashMap[BlockRange, AtomicInteger]()
  private val live = ConcurrentHashMap.newKeySet[Long]()
  private val nextLease = new AtomicLong(1)
  private val pool = Executors.newFixedThreadPool(
    2,
    (r: Runnable) => {
      val t = new Thread(r, "loopback-engine")
      t.setDaemon(true)
      t
    })

  val registered = new AtomicInteger()
  val unregisteredShuffles = ConcurrentHashMap.newKeySet[Int]()
  val blocksServed = new AtomicLong()
  val bytesServed = new AtomicLong()
  val leasesReleased = new AtomicLong()
  val doubleReleases = new AtomicLong()
  @volatile var closed = false

  override val port: Int = 7

  override val transport: String = "loopback"

  override def registerMapOutput(
      shuffleId: Int,
      mapId: Long,
      dataFile: File,
      indexFile: File,
      numPartitions: Int): Unit = {
    if (refuseRegistration(shuffleId, mapId)) {
      throw new RdmaShuffleException(
        "register",
        s"injected: shuffle $shuffleId map $mapId cannot be registered")
    }
    require(indexFile.exists(), s"index file $indexFile missing at commit")
    require(
      indexFile.length() == 8L * (numPartitions + 1),
      s"index $indexFile has ${indexFile.length()} bytes for $numPartitions partitions")
    outputs.put((shuffleId, mapId), (dataFile, indexFile, numPartitions))
    registered.incrementAndGet()
  }

  /** Registered map outputs of a shuffle. */
  def outputsOf(shuffleId: Int): Int = {
    var n = 0
    outputs.keySet().forEach(k => if (k._1 == shuffleId) n += 1)
    n
  }

  override def unregisterShuffle(shuffleId: Int): Int = {
    val n = outputsOf(shuffleId)
    outputs.keySet().removeIf(_._1 == shuffleId)
    unregisteredShuffles.add(shuffleId)
    n
  }

  override def fetchBlocks(
      host: String,
      port: Int,
      blocks: IndexedSeq[BlockRange],
      callback: FetchCallback): Unit = {
    require(port == this.port, s"fetch sent to port $port, engine is on ${this.port}")
    pool.execute(() => {
      blocks.zipWithIndex.foreach { case (b, i) =>
        val attempt = attempts.computeIfAbsent(b, _ => new AtomicInteger()).incrementAndGet()
        failure(b, attempt) match {
          case Some((kind, msg)) => callback.onFailure(i, kind, msg)
          case None =>
            Option(outputs.get((b.shuffleId, b.mapId))) match {
              // The native engine's kind for a map output it does not have.
              case None => callback.onFailure(i, "unknown_map_output", s"no map output $b")
              case Some((data, index, _)) =>
                val buf = read(data, index, b)
                val lease = nextLease.getAndIncrement()
                live.add(lease)
                blocksServed.incrementAndGet()
                bytesServed.addAndGet(buf.remaining())
                callback.onBlock(i, buf, lease)
            }
        }
      }
    })
  }

  private def read(data: File, index: File, b: BlockRange): ByteBuffer = {
    val in = new DataInputStream(new FileInputStream(index))
    val offsets =
      try {
        in.skipBytes(8 * b.startReduceId)
        val start = in.readLong()
        in.skipBytes(8 * (b.endReduceId - b.startReduceId - 1))
        (start, in.readLong())
      } finally in.close()
    val len = (offsets._2 - offsets._1).toInt
    val buf = ByteBuffer.allocateDirect(len)
    val raf = new RandomAccessFile(data, "r")
    try {
      raf.getChannel.read(buf, offsets._1)
    } finally raf.close()
    buf.flip()
    buf
  }

  override def releaseLease(lease: Long): Unit = {
    if (live.remove(lease)) leasesReleased.incrementAndGet() else doubleReleases.incrementAndGet()
  }

  /** Leases handed out and not released. */
  def outstanding: Int = live.size()

  override def stats: Seq[(String, String)] = Seq(
    "blocks_served" -> blocksServed.get.toString,
    "bytes_served" -> bytesServed.get.toString,
    "blocks_fetched" -> blocksServed.get.toString,
    "bytes_fetched" -> bytesServed.get.toString
  )

  override def close(): Unit = {
    closed = true
    pool.shutdown()
    pool.awaitTermination(5, TimeUnit.SECONDS)
  }
}
