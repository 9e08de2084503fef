/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.{File, IOException, RandomAccessFile}
import java.nio.file.Files

import scala.collection.JavaConverters._

import org.junit.Assert._
import org.junit.Test

import org.apache.spark.network.buffer.{FileSegmentManagedBuffer, NioManagedBuffer}
import org.apache.spark.network.util.{MapConfigProvider, TransportConf}
import org.apache.spark.storage.ShuffleBlockId

class CheckedIndexShuffleBlockResolverTest {

  private val tc =
    new TransportConf("shuffle", new MapConfigProvider(Map.empty[String, String].asJava))
  private val id = ShuffleBlockId(3, 7L, 1)

  private def dataFile(bytes: Int): File = {
    val f = Files.createTempFile("shuffle_3_7_0", ".data").toFile
    f.deleteOnExit()
    Files.write(f.toPath, Array.fill[Byte](bytes)(1))
    f
  }

  private def failure(f: => Any): IOException =
    try { f; fail("expected an IOException"); null }
    catch { case e: IOException => e }

  @Test def aWholeSegmentPasses(): Unit = {
    val f = dataFile(1000)
    val seg = new FileSegmentManagedBuffer(tc, f, 600, 400)
    assertSame(seg, CheckedIndexShuffleBlockResolver.verified(id, seg))
    val other = new NioManagedBuffer(java.nio.ByteBuffer.allocate(1))
    assertSame(other, CheckedIndexShuffleBlockResolver.verified(id, other))
  }

  @Test def aFileTruncatedAfterCommitIsAnError(): Unit = {
    val f = dataFile(1000)
    val seg = new FileSegmentManagedBuffer(tc, f, 600, 400)
    new RandomAccessFile(f, "rw").setLength(700)
    val e = failure(CheckedIndexShuffleBlockResolver.verified(id, seg))
    assertTrue(e.getMessage, e.getMessage.contains("shuffle_3_7_1: data file truncated"))
    assertTrue(
      e.getMessage,
      e.getMessage.contains("is 700 bytes, the block needs bytes [600, 1000)"))
    assertTrue(e.getMessage, e.getMessage.contains(f.getPath))
  }

  @Test def aDeletedFileIsAnError(): Unit = {
    val f = dataFile(1000)
    val seg = new FileSegmentManagedBuffer(tc, f, 0, 10)
    assertTrue(f.delete())
    val e = failure(CheckedIndexShuffleBlockResolver.verified(id, seg))
    assertTrue(e.getMessage, e.getMessage.contains("data file missing"))
  }
}
