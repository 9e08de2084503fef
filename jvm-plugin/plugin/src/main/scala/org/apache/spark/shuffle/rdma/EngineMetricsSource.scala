/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import scala.collection.mutable
import scala.util.control.NonFatal

import com.codahale.metrics.{Gauge, MetricRegistry}

import org.apache.spark.internal.Logging
import org.apache.spark.metrics.source.Source

/**
 * The engine's counters and gauges as a Spark metrics source named `rdmaShuffle`: every numeric
 * `key=value` the engine reports (`NativeBridge.engineStats`, plus this JVM's request routing
 * counts) is a gauge of the same name, e.g. `<app>.<executor>.rdmaShuffle.bytes_fetched`. Keys
 * are not listed here: a counter the engine adds later becomes a gauge the first time it is
 * seen, so the native side can grow its counters without a JVM change.
 *
 * Reading: a sink reads every gauge once per report. The first gauge read after a gauge was
 * already read refreshes the snapshot (one JNI call per report, and the values of one report
 * come from one snapshot). When the engine cannot be read (closed, failing), the last snapshot
 * stays: a sink never sees an exception or a drop to zero.
 *
 * @param read the current counters as `key -> value`; non-numeric values are skipped
 */
final class EngineMetricsSource(read: () => Seq[(String, String)]) extends Source with Logging {

  override val sourceName: String = EngineMetricsSource.Name

  override val metricRegistry: MetricRegistry = new MetricRegistry

  private var snapshot: Map[String, Long] = Map.empty
  private val readSinceRefresh = mutable.Set[String]()
  private val registered = mutable.Set[String]()

  refresh()

  /** The value of `key` for the current report (refreshing once per report). */
  def value(key: String): Long = synchronized {
    if (readSinceRefresh.contains(key)) refresh()
    readSinceRefresh += key
    snapshot.getOrElse(key, 0L)
  }

  /** Reads the counters and registers a gauge for every key not seen before. */
  def refresh(): Unit = synchronized {
    readSinceRefresh.clear()
    val now =
      try read()
      catch {
        case NonFatal(e) =>
          logDebug("RDMA shuffle engine counters could not be read; keeping the last values", e)
          Nil
      }
    val numeric = now.flatMap { case (k, v) =>
      try Some(k -> v.trim.toLong)
      catch { case _: NumberFormatException => None }
    }
    if (numeric.nonEmpty) snapshot = snapshot ++ numeric
    numeric.map(_._1).filterNot(registered.contains).foreach { key =>
      registered += key
      // Registration forwards to Spark's registry (the parent listens to this one), so a new
      // key reaches every sink from the next report on.
      metricRegistry.register(key, new Gauge[Long] { override def getValue: Long = value(key) })
    }
  }
}

/** Names of the metrics source. */
object EngineMetricsSource {

  /** The source name that prefixes every gauge. */
  val Name = "rdmaShuffle"
}
