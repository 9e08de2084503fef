/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.util.concurrent.atomic.AtomicInteger

import scala.collection.JavaConverters._

import com.codahale.metrics.MetricRegistry
import org.junit.Assert._
import org.junit.Test

class EngineMetricsSourceTest {

  /** A fake engine whose counters the test sets, counting how often they are read. */
  private class Counters {
    @volatile var stats: Seq[(String, String)] = Nil
    @volatile var failing = false
    val reads = new AtomicInteger()
    def read(): Seq[(String, String)] = {
      reads.incrementAndGet()
      if (failing) throw new RdmaShuffleException("closed", "engine closed")
      stats
    }
  }

  private def gauge(r: MetricRegistry, name: String): Long =
    r.getGauges.get(name).getValue.asInstanceOf[Long]

  @Test def everyNumericKeyIsAGaugeAndNewKeysFlowThrough(): Unit = {
    val c = new Counters
    c.stats = Seq("transport" -> "tcp", "bytes_fetched" -> "100", "blocks_fetched" -> "2")
    val source = new EngineMetricsSource(() => c.read())
    assertEquals("rdmaShuffle", source.sourceName)
    // Spark's MetricsSystem registers a source's registry under its name in its own registry.
    val spark = new MetricRegistry
    spark.register("app-1.7.rdmaShuffle", source.metricRegistry)
    assertEquals(
      Set("app-1.7.rdmaShuffle.bytes_fetched", "app-1.7.rdmaShuffle.blocks_fetched"),
      spark.getGauges.keySet.asScala.toSet)
    assertEquals(100L, gauge(spark, "app-1.7.rdmaShuffle.bytes_fetched"))

    // A key the engine starts reporting later becomes a gauge at the next report.
    c.stats = Seq("bytes_fetched" -> "250", "blocks_fetched" -> "3", "read_bytes" -> "9")
    assertEquals(
      "a second read of a gauge starts a new report",
      250L,
      gauge(spark, "app-1.7.rdmaShuffle.bytes_fetched"))
    assertEquals(9L, gauge(spark, "app-1.7.rdmaShuffle.read_bytes"))
    assertEquals(3L, gauge(spark, "app-1.7.rdmaShuffle.blocks_fetched"))
  }

  @Test def oneReadPerReportAndNoFailureReachesTheSink(): Unit = {
    val c = new Counters
    c.stats = Seq("a" -> "1", "b" -> "2", "c" -> "3")
    val source = new EngineMetricsSource(() => c.read())
    val gauges = source.metricRegistry.getGauges.asScala
    val before = c.reads.get()
    for (_ <- 1 to 3) gauges.values.foreach(_.getValue)
    // The first pass uses the registration snapshot; passes two and three read once each.
    assertEquals(2, c.reads.get() - before)

    c.stats = Seq("a" -> "10", "b" -> "20", "c" -> "30")
    c.failing = true
    for (_ <- 1 to 2) {
      assertEquals(
        "the last values stay when the engine cannot be read",
        Map("a" -> 1L, "b" -> 2L, "c" -> 3L),
        gauges.map { case (k, g) => k -> g.getValue }.toMap)
    }
    c.failing = false
    gauges.values.foreach(_.getValue)
    assertEquals(
      Map("a" -> 10L, "b" -> 20L, "c" -> 30L),
      gauges.map { case (k, g) => k -> g.getValue }.toMap)
  }
}
