/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.File
import java.net.URL
import java.nio.file.Files

import scala.collection.mutable.ArrayBuffer

import org.junit.Assert._
import org.junit.Test

class NativeLoaderTest {
  private class FakeLoader(pathLoads: Boolean, resource: Option[URL], fileLoads: Boolean)
    extends NativeLoader.Loader {
    val loadedFiles = ArrayBuffer[String]()

    /** What each loaded file held at load time (the loader deletes its copy afterwards). */
    val loadedBytes = ArrayBuffer[Array[Byte]]()
    override def loadLibrary(name: String): Unit =
      if (!pathLoads) throw new UnsatisfiedLinkError(s"no $name in java.library.path")
    override def load(absolutePath: String): Unit = {
      loadedFiles += absolutePath
      loadedBytes += Files.readAllBytes(new File(absolutePath).toPath)
      if (!fileLoads) throw new UnsatisfiedLinkError(s"$absolutePath: invalid ELF header")
    }
    override def resource(path: String): URL = resource.orNull
  }

  @Test def libraryPathWins(): Unit = {
    val o = NativeLoader.attempt(new FakeLoader(true, None, false), "linux", "x86_64")
    assertTrue(o.isLoaded)
    assertEquals("java.library.path", o.source())
  }

  @Test def missingEverywhereExplainsBoth(): Unit = {
    val o = NativeLoader.attempt(new FakeLoader(false, None, false), "linux", "x86_64")
    assertFalse(o.isLoaded)
    assertTrue(o.failure().contains("java.library.path"))
    assertTrue(o.failure().contains(
      "/org/apache/spark/shuffle/rdma/native/linux/x86_64/librdma_shuffle_jni.so"))
  }

  @Test def bundledCopyIsExtractedAndLoaded(): Unit = {
    val src = Files.createTempFile("fake-lib", ".so")
    Files.write(src, Array[Byte](1, 2, 3, 4))
    val loader = new FakeLoader(false, Some(src.toUri.toURL), true)
    val o = NativeLoader.attempt(loader, "linux", "x86_64")
    assertTrue(o.isLoaded)
    assertEquals(1, loader.loadedFiles.size)
    val extracted = new File(loader.loadedFiles.head)
    assertEquals(o.source(), extracted.getAbsolutePath)
    assertArrayEquals(Array[Byte](1, 2, 3, 4), loader.loadedBytes.head)
    assertFalse("the extracted copy is deleted once loaded", extracted.exists())
    Files.delete(src)
  }

  @Test def brokenBundledCopyFailsAndIsRemoved(): Unit = {
    val src = Files.createTempFile("fake-lib", ".so")
    val loader = new FakeLoader(false, Some(src.toUri.toURL), false)
    val o = NativeLoader.attempt(loader, "linux", "aarch64")
    assertFalse(o.isLoaded)
    assertTrue(o.failure().contains("invalid ELF header"))
    assertFalse("temp copy removed", new File(loader.loadedFiles.head).exists())
    Files.delete(src)
  }

  @Test def platformNames(): Unit = {
    assertEquals("linux", NativeLoader.osName("Linux"))
    assertEquals("macos", NativeLoader.osName("Mac OS X"))
    assertEquals("x86_64", NativeLoader.archName("amd64"))
    assertEquals("aarch64", NativeLoader.archName("arm64"))
  }

  @Test def realLoadIsCachedAndAbsentHere(): Unit = {
    // This build ships no native library: the JVM-wide load must fail, and fail the same way
    // (same cached object) when asked again.
    val first = NativeLoader.load()
    assertSame(first, NativeLoader.load())
    if (!first.isLoaded) assertNotNull(first.failure())
  }
}
