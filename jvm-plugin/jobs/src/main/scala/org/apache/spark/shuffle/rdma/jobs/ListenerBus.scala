/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma.jobs

import org.apache.spark.SparkContext

/**
 * Waits for Spark's listener bus to deliver every event posted so far.
 *
 * Task-end events (and the task metrics they carry) reach listeners asynchronously. By the
 * time an action returns, the scheduler has posted the task-end of each of its tasks, so once
 * the bus is empty a listener has counted them all. The jobs print those counts and the tests
 * compare them exactly with the engine's counters, so a fixed sleep here would be a race on a
 * loaded machine. `SparkContext.listenerBus` is `private[spark]`, reachable because these jobs
 * live under `org.apache.spark`.
 */
private[jobs] object ListenerBus {

  /**
   * Generous on purpose: the bus normally drains in milliseconds, and a timeout here means
   * a listener is stuck, which the caller should hear about rather than print partial counts.
   */
  val DrainTimeoutMs: Long = 120000L

  /** Blocks until every queue of the bus is empty; throws TimeoutException after DrainTimeoutMs. */
  def drain(sc: SparkContext): Unit = sc.listenerBus.waitUntilEmpty(DrainTimeoutMs)
}
