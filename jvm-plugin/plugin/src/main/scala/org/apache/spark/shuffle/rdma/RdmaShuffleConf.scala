/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.util.Locale

import scala.util.control.NonFatal

import org.apache.spark.SparkConf
import org.apache.spark.network.util.JavaUtils

/**
 * Raised when a `spark.shuffle.rdma.*` setting has a value the plugin cannot use. The message
 * names the key, the bad value and what is allowed.
 */
class RdmaShuffleConfigException(message: String) extends IllegalArgumentException(message)

/**
 * All `spark.shuffle.rdma.*` settings in one place: keys, defaults, documentation, parsing.
 *
 * The parsed form is handed to the native engine as `key=value` lines (sizes in bytes,
 * durations in milliseconds) so that the native side needs no defaults and no unit parsing of
 * its own.
 */
object RdmaShuffleConf {
  /** Prefix of every setting of this plugin. */
  val Prefix = "spark.shuffle.rdma."

  /** One documented setting. */
  final case class Entry(key: String, default: String, doc: String)

  /** `true` (default) uses the plugin; `false` hands every shuffle to Spark's sort shuffle. */
  val Enabled = Entry(Prefix + "enabled", "true",
    "Use the native engine for shuffles. false hands every shuffle to Spark's sort shuffle.")

  /** Which fabric provider the engine uses. */
  val Transport = Entry(Prefix + "transport", "auto",
    "auto (verbs when an RDMA device is usable, else tcp) | verbs (fail without a device) | tcp.")

  /** Blocks smaller than this are sent inline (eager); larger ones by descriptor + pull. */
  val EagerThreshold = Entry(Prefix + "eagerThreshold", "64k",
    "Blocks up to this size are copied into a send buffer and sent inline; larger ones are " +
      "announced by descriptor and pulled (RDMA READ, or a streamed region over tcp).")

  /** Size classes of the registered-memory pool. */
  val PoolTiers = Entry(Prefix + "pool.tiers", "4k,16k,64k,256k,1m,2m,4m,8m,16m",
    "Comma-separated size classes of the registered buffer pool, ascending. A block takes " +
      "the smallest class that holds it; larger steps waste more memory per block.")

  /** Hard cap on the pool's total bytes. */
  val PoolCapBytes = Entry(Prefix + "pool.capBytes", "512m",
    "Hard cap on all pool memory of one executor; callers wait for free buffers beyond it.")

  /** Port of the engine's server. */
  val Port = Entry(Prefix + "port", "0",
    "Port of the engine's block server; 0 picks a free ephemeral port.")

  /** Connection set-up timeout; default follows Spark's own setting. */
  val ConnectTimeout = Entry(Prefix + "connectTimeout", "",
    "Connection set-up timeout. Default: spark.shuffle.io.connectionTimeout (which itself " +
      "defaults to spark.network.timeout, 120s).")

  /** Timeout of one fetch with no progress; default follows Spark's network timeout. */
  val FetchTimeout = Entry(Prefix + "fetchTimeout", "",
    "A fetch that makes no progress for this long fails (and Spark's retry / FetchFailed " +
      "handling takes over). Default: spark.network.timeout (120s).")

  /** Every documented setting, for docs and for the engine config. */
  val All: Seq[Entry] = Seq(Enabled, Transport, EagerThreshold, PoolTiers, PoolCapBytes, Port,
    ConnectTimeout, FetchTimeout)

  private val Transports = Set("auto", "verbs", "tcp")

  /**
   * Parses and validates the settings.
   *
   * @throws RdmaShuffleConfigException naming the key and the allowed values
   */
  def apply(conf: SparkConf): RdmaShuffleConf = {
    def raw(e: Entry): String = conf.get(e.key, e.default).trim

    def bytes(e: Entry): Long = {
      val v = raw(e)
      val n = try JavaUtils.byteStringAsBytes(v) catch {
        case NonFatal(_) =>
          throw new RdmaShuffleConfigException(
            s"${e.key}='$v' is not a size (examples: 65536, 64k, 16m; default ${e.default})")
      }
      if (n <= 0) {
        throw new RdmaShuffleConfigException(s"${e.key}='$v' must be a positive size")
      }
      n
    }

    def millis(e: Entry, fallback: => String): Long = {
      val v = if (conf.contains(e.key)) conf.get(e.key).trim else fallback
      val n = try JavaUtils.timeStringAsMs(v) catch {
        case NonFatal(_) =>
          throw new RdmaShuffleConfigException(
            s"${e.key}='$v' is not a duration (examples: 30s, 2min, 500ms)")
      }
      if (n <= 0) throw new RdmaShuffleConfigException(s"${e.key}='$v' must be positive")
      n
    }

    val enabled = raw(Enabled).toLowerCase(Locale.ROOT) match {
      case "true" => true
      case "false" => false
      case other =>
        throw new RdmaShuffleConfigException(s"${Enabled.key}='$other' must be true or false")
    }
    val transport = raw(Transport).toLowerCase(Locale.ROOT)
    if (!Transports.contains(transport)) {
      throw new RdmaShuffleConfigException(
        s"${Transport.key}='$transport' must be one of ${Transports.toSeq.sorted.mkString("|")}")
    }
    val tiersRaw = raw(PoolTiers)
    val tiers = tiersRaw.split(",").map(_.trim).filter(_.nonEmpty).map { t =>
      try JavaUtils.byteStringAsBytes(t) catch {
        case NonFatal(_) => throw new RdmaShuffleConfigException(
          s"${PoolTiers.key}='$tiersRaw': '$t' is not a size (example: ${PoolTiers.default})")
      }
    }.toSeq
    if (tiers.isEmpty || tiers.exists(_ <= 0) || tiers.zip(tiers.drop(1)).exists(p => p._1 >= p._2)) {
      throw new RdmaShuffleConfigException(
        s"${PoolTiers.key}='$tiersRaw' must list positive sizes in strictly ascending order " +
          s"(example: ${PoolTiers.default})")
    }
    val cap = bytes(PoolCapBytes)
    if (cap < tiers.last) {
      throw new RdmaShuffleConfigException(
        s"${PoolCapBytes.key}=$cap bytes is smaller than the largest pool tier (${tiers.last} " +
          s"bytes); raise ${PoolCapBytes.key} or lower ${PoolTiers.key}")
    }
    val eager = bytes(EagerThreshold)
    val portRaw = raw(Port)
    val port = try portRaw.toInt catch {
      case _: NumberFormatException =>
        throw new RdmaShuffleConfigException(s"${Port.key}='$portRaw' is not a port number")
    }
    if (port < 0 || port > 65535) {
      throw new RdmaShuffleConfigException(s"${Port.key}=$port must be within 0..65535")
    }
    // Spark's own defaults: spark.shuffle.io.connectionTimeout falls back to
    // spark.network.timeout, which defaults to 120s.
    val networkTimeout = conf.get("spark.network.timeout", "120s")
    val connect = millis(ConnectTimeout,
      conf.get("spark.shuffle.io.connectionTimeout", networkTimeout))
    val fetch = millis(FetchTimeout, networkTimeout)

    RdmaShuffleConf(enabled, transport, eager, tiers, cap, port, connect, fetch,
      conf.getAllWithPrefix(Prefix).toMap)
  }
}

/**
 * Parsed `spark.shuffle.rdma.*` settings (see the companion object for their meaning).
 *
 * @param rawSettings every `spark.shuffle.rdma.*` key as the user set it (prefix stripped);
 *                    passed through to the engine so that native-only settings need no JVM
 *                    change
 */
final case class RdmaShuffleConf(
    enabled: Boolean,
    transport: String,
    eagerThresholdBytes: Long,
    poolTierBytes: Seq[Long],
    poolCapBytes: Long,
    port: Int,
    connectTimeoutMs: Long,
    fetchTimeoutMs: Long,
    rawSettings: Map[String, String]) {

  import RdmaShuffleConf._

  /**
   * The resolved settings, in canonical units, keyed by their full names.
   * Typed settings override the raw pass-through of the same key.
   */
  def resolved: Seq[(String, String)] = {
    val typed = Seq(
      Enabled.key -> enabled.toString,
      Transport.key -> transport,
      EagerThreshold.key -> eagerThresholdBytes.toString,
      PoolTiers.key -> poolTierBytes.mkString(","),
      PoolCapBytes.key -> poolCapBytes.toString,
      Port.key -> port.toString,
      ConnectTimeout.key -> connectTimeoutMs.toString,
      FetchTimeout.key -> fetchTimeoutMs.toString)
    val typedKeys = typed.map(_._1).toSet
    val passThrough = rawSettings.toSeq.map { case (k, v) => (Prefix + k, v) }
      .filterNot(kv => typedKeys.contains(kv._1)).sortBy(_._1)
    typed ++ passThrough
  }

  /**
   * The text handed to `NativeBridge.engineOpen`: one `key=value` per line.
   *
   * @param executorId this executor's id (`driver` in local mode)
   * @param appId the application id
   * @param authSecret the app's `spark.authenticate` secret when authentication is on
   * @throws RdmaShuffleConfigException when a value contains a line break (it would corrupt
   *                                    the line format)
   */
  def engineConfig(executorId: String, appId: String, authSecret: Option[String]): String = {
    val lines = resolved ++ Seq("spark.executor.id" -> executorId, "spark.app.id" -> appId) ++
      authSecret.toSeq.flatMap(s =>
        Seq("spark.authenticate" -> "true", "spark.authenticate.secret" -> s))
    lines.foreach { case (k, v) =>
      if (k.exists(c => c == '\n' || c == '\r' || c == '=') || v.exists(c => c == '\n' || c == '\r')) {
        // Never echo the secret's value.
        val shown = if (k == "spark.authenticate.secret") "<secret>" else s"'$v'"
        throw new RdmaShuffleConfigException(
          s"setting $k=$shown cannot be passed to the native engine: keys may not contain " +
            "'=' or line breaks, values may not contain line breaks")
      }
    }
    lines.map { case (k, v) => s"$k=$v" }.mkString("", "\n", "\n")
  }
}
