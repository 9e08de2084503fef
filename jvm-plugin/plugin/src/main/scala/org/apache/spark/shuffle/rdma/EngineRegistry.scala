/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.util.concurrent.ConcurrentHashMap

import scala.util.control.NonFatal

import org.apache.spark.SparkConf
import org.apache.spark.internal.Logging
import org.apache.spark.rpc.{RpcCallContext, RpcEndpointRef, RpcEnv, ThreadSafeRpcEndpoint}
import org.apache.spark.util.RpcUtils

/** Messages between executors and the driver's [[EngineRegistryEndpoint]]. */
private[rdma] object EngineRegistryMessages {

  /** An executor's engine is up at `host:port`. Replied with `true`. */
  final case class RegisterEngine(executorId: String, host: String, port: Int, transport: String)

  /**
   * Where is `executorId`'s engine? Replied with `Option[(String, Int)]` (host, port), never a
   * class of this plugin: an executor deserializes RPC replies with the class loader its
   * RpcEnv was created with, which does not see jars shipped with `--jars`/`spark.jars`. A reply
   * holding a plugin class fails there with ClassNotFoundException inside Netty, which drops
   * the executor's connection to the driver and makes the executor exit ("Driver
   * disassociated"). Messages from executors to the driver may carry plugin classes: the
   * driver's RpcEnv is created after the application jars are on its class loader.
   */
  final case class LookupEngine(executorId: String)

  /** The wire form of a [[LookupEngine]] reply: JDK and Scala library types only. */
  def lookupReply(address: Option[EngineAddress]): Option[(String, Int)] =
    address.map(a => (a.host, a.port))

  /**
   * An executor's engine counters (cumulative), sent one-way after each reduce task. The driver
   * keeps the latest per executor and logs them when it stops: executors of a standalone or
   * local-cluster are killed right after the driver commands their shutdown, so their own
   * stop-time log line is often lost, while the driver's log is complete.
   */
  final case class EngineStats(executorId: String, stats: Seq[(String, String)])

  /** `executorId`'s engine is gone (stop). One-way: the driver may already be gone. */
  final case class UnregisterEngine(executorId: String)
}

/**
 * Driver-side directory of executor engines. Executors register their engine before their first
 * map output is committed, so by the time a reducer sees a block of executor E in a MapStatus,
 * E's engine (if it has one) is known here.
 */
private[rdma] final class EngineRegistryEndpoint(override val rpcEnv: RpcEnv)
  extends ThreadSafeRpcEndpoint with Logging {
  import EngineRegistryMessages._

  private val engines = new ConcurrentHashMap[String, EngineAddress]()
  private val latestStats = new ConcurrentHashMap[String, Seq[(String, String)]]()

  /** The latest counters each executor reported. */
  def statsByExecutor: Map[String, Seq[(String, String)]] = {
    val b = Map.newBuilder[String, Seq[(String, String)]]
    latestStats.forEach((k, v) => b += k -> v)
    b.result()
  }

  /** Engines currently known, for tests and logs. */
  def snapshot: Map[String, EngineAddress] = {
    val b = Map.newBuilder[String, EngineAddress]
    val it = engines.entrySet().iterator()
    while (it.hasNext) { val e = it.next(); b += e.getKey -> e.getValue }
    b.result()
  }

  override def receiveAndReply(context: RpcCallContext): PartialFunction[Any, Unit] = {
    case RegisterEngine(executorId, host, port, transport) =>
      engines.put(executorId, EngineAddress(host, port))
      logInfo(s"RDMA shuffle engine of executor $executorId registered at $host:$port " +
        s"(transport $transport)")
      context.reply(true)
    case LookupEngine(executorId) =>
      context.reply(lookupReply(Option(engines.get(executorId))))
  }

  override def receive: PartialFunction[Any, Unit] = {
    case UnregisterEngine(executorId) =>
      engines.remove(executorId)
    case EngineStats(executorId, stats) =>
      latestStats.put(executorId, stats)
  }
}

/** Names and helpers around the registry endpoint. */
private[rdma] object EngineRegistry {

  /** The RPC endpoint name on the driver. */
  val EndpointName = "RdmaShuffleEngineRegistry"

  /** Registers the endpoint on the driver's RpcEnv. */
  def startDriverEndpoint(rpcEnv: RpcEnv): (EngineRegistryEndpoint, RpcEndpointRef) = {
    val endpoint = new EngineRegistryEndpoint(rpcEnv)
    (endpoint, rpcEnv.setupEndpoint(EndpointName, endpoint))
  }

  /** A reference to the driver's endpoint, from an executor. */
  def driverRef(conf: SparkConf, rpcEnv: RpcEnv): RpcEndpointRef =
    RpcUtils.makeDriverRef(EndpointName, conf, rpcEnv)
}

/**
 * The executor-side view of the registry: looks executors up on the driver and caches the
 * answers that cannot change (an executor id is never reused, and its engine's address is fixed
 * for its lifetime). "No engine" is not cached: it is the rare mixed case, and asking again
 * costs one RPC per fetch request to such an executor.
 */
final class CachingEngineDirectory(driver: RpcEndpointRef)
  extends EngineDirectory with Logging {
  import EngineRegistryMessages._

  private val cache = new ConcurrentHashMap[String, EngineAddress]()

  override def lookup(executorId: String): Option[EngineAddress] = {
    val hit = cache.get(executorId)
    if (hit != null) {
      Some(hit)
    } else {
      val answer =
        try {
          driver.askSync[Option[(String, Int)]](LookupEngine(executorId))
            .map { case (host, port) => EngineAddress(host, port) }
        } catch {
          case NonFatal(e) =>
            // The driver is unreachable or slow: Spark's own transfer path still works.
            logWarning(
              s"Could not look up the shuffle engine of executor $executorId; " +
                "fetching its blocks through Spark's block transfer service",
              e)
            None
        }
      answer.foreach(a => cache.putIfAbsent(executorId, a))
      answer
    }
  }

  /** Registers this executor's engine; throws if the driver does not answer. */
  def register(executorId: String, host: String, port: Int, transport: String): Unit = {
    driver.askSync[Boolean](RegisterEngine(executorId, host, port, transport))
    cache.put(executorId, EngineAddress(host, port))
  }

  /** Best effort, never blocks: reports this engine's counters to the driver. */
  def reportStats(executorId: String, stats: Seq[(String, String)]): Unit = {
    try driver.send(EngineStats(executorId, stats))
    catch {
      case NonFatal(e) => logDebug(s"Could not report engine stats of $executorId", e)
    }
  }

  /** Best effort, never blocks: tells the driver this engine is going away. */
  def unregister(executorId: String): Unit = {
    cache.remove(executorId)
    try driver.send(UnregisterEngine(executorId))
    catch {
      case NonFatal(e) => logDebug(s"Could not unregister engine of $executorId", e)
    }
  }
}
