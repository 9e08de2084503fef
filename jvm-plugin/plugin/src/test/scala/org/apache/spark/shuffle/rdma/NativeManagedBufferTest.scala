/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.nio.ByteBuffer

import scala.collection.mutable.ArrayBuffer

import org.junit.Assert._
import org.junit.Test

class NativeManagedBufferTest {
  private def direct(bytes: Array[Byte]): ByteBuffer = {
    val b = ByteBuffer.allocateDirect(bytes.length)
    b.put(bytes).flip()
    b
  }

  @Test def releasesLeaseExactlyOnceWhenCountReachesZero(): Unit = {
    val released = ArrayBuffer[Long]()
    val buf = new NativeManagedBuffer(direct(Array[Byte](1, 2, 3)), 42L, l => released += l)
    buf.retain()
    buf.release()
    assertTrue(released.isEmpty)
    buf.release()
    assertEquals(Seq(42L), released.toSeq)
    assertThrows(classOf[IllegalStateException], () => buf.release())
    assertThrows(classOf[IllegalStateException], () => buf.retain())
    assertThrows(classOf[IllegalStateException], () => buf.createInputStream())
    assertEquals(Seq(42L), released.toSeq)
  }

  @Test def exposesTheBytesWithoutMovingTheSource(): Unit = {
    val src = direct(Array[Byte](9, 8, 7, 6, 5))
    val buf = new NativeManagedBuffer(src, 1L, _ => ())
    assertEquals(5L, buf.size())
    val in = buf.createInputStream()
    assertEquals(9, in.read())
    val rest = new Array[Byte](10)
    assertEquals(4, in.read(rest, 0, 10))
    assertEquals(-1, in.read())
    assertArrayEquals(Array[Byte](8, 7, 6, 5), rest.take(4))
    assertEquals("reading did not consume the buffer", 5, buf.nioByteBuffer().remaining())
    assertEquals(0, src.position())
  }

  @Test def concurrentReleasesReleaseOnce(): Unit = {
    val count = new java.util.concurrent.atomic.AtomicInteger()
    val buf = new NativeManagedBuffer(direct(Array[Byte](1)), 5L, _ => count.incrementAndGet())
    (1 until 64).foreach(_ => buf.retain())
    val threads = (0 until 8).map(_ => new Thread(() => (0 until 8).foreach(_ => buf.release())))
    threads.foreach(_.start())
    threads.foreach(_.join())
    assertEquals(1, count.get())
    assertEquals(0, buf.referenceCount)
  }
}
