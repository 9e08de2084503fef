/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.InputStream
import java.nio.ByteBuffer
import java.util.concurrent.atomic.AtomicInteger

import io.netty.buffer.Unpooled

import org.apache.spark.network.buffer.ManagedBuffer

/**
 * A fetched block living in native, pooled memory, as Spark's [[ManagedBuffer]].
 *
 * Reference counted the way Spark's fetch path expects: the creator holds one reference and
 * drops it after handing the buffer to `BlockFetchingListener.onBlockFetchSuccess` (which
 * `retain()`s what it keeps); when the count reaches zero the lease goes back to the engine
 * exactly once. The bytes must not be read after that: the memory may already hold another
 * block. Every accessor therefore checks the count.
 *
 * @param buf direct buffer over the block (position 0, limit = length)
 * @param lease the engine's lease for the memory
 * @param releaseLease gives the lease back; called exactly once
 */
final class NativeManagedBuffer(buf: ByteBuffer, lease: Long, releaseLease: Long => Unit)
  extends ManagedBuffer {

  private val refCnt = new AtomicInteger(1)

  private def live(): Unit = {
    if (refCnt.get() <= 0) {
      throw new IllegalStateException(s"native block buffer (lease $lease) used after release")
    }
  }

  /** Current reference count; 0 once the lease has been returned. */
  def referenceCount: Int = refCnt.get()

  override def size(): Long = buf.remaining()

  override def nioByteBuffer(): ByteBuffer = {
    live()
    buf.duplicate()
  }

  override def createInputStream(): InputStream = {
    live()
    new DirectBufferInputStream(buf.duplicate())
  }

  override def retain(): ManagedBuffer = {
    // A CAS loop, not getAndIncrement: resurrecting a released buffer must fail, not succeed.
    var done = false
    while (!done) {
      val c = refCnt.get()
      if (c <= 0) {
        throw new IllegalStateException(s"retain() of released native block buffer (lease $lease)")
      }
      done = refCnt.compareAndSet(c, c + 1)
    }
    this
  }

  override def release(): ManagedBuffer = {
    val c = refCnt.decrementAndGet()
    if (c == 0) {
      releaseLease(lease)
    } else if (c < 0) {
      refCnt.incrementAndGet()
      throw new IllegalStateException(s"release() of released native block buffer (lease $lease)")
    }
    this
  }

  override def convertToNetty(): AnyRef = {
    live()
    Unpooled.wrappedBuffer(buf.duplicate())
  }

  // Abstract in Spark 4 only; on 3.5 this is simply an extra method.
  def convertToNettyForSsl(): AnyRef = convertToNetty()

  override def toString: String =
    s"NativeManagedBuffer(lease=$lease, size=${size()}, refCnt=$referenceCount)"
}

/** An InputStream over a ByteBuffer that it owns (a duplicate), without copying. */
private[rdma] final class DirectBufferInputStream(b: ByteBuffer) extends InputStream {
  override def read(): Int = if (b.hasRemaining) b.get() & 0xff else -1

  override def read(dst: Array[Byte], off: Int, len: Int): Int = {
    if (len == 0) {
      0
    } else if (!b.hasRemaining) {
      -1
    } else {
      val n = math.min(len, b.remaining())
      b.get(dst, off, n)
      n
    }
  }

  override def skip(n: Long): Long = {
    val k = math.max(0L, math.min(n, b.remaining().toLong)).toInt
    b.position(b.position() + k)
    k
  }

  override def available(): Int = b.remaining()
}
