/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.net.InetAddress
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
 * Resolves the `spark.shuffle.rdma.*` settings declared in the schema ([[SettingsSchema]],
 * `settings/settings.tsv`): the key itself, else its fallbacks (other Spark settings, or the
 * executor's host), else the schema's default; parsed with Spark's own unit syntax and checked
 * against the schema's range.
 *
 * The resolved values are handed to the native engine as canonical `key=value` lines (sizes in
 * bytes, durations in milliseconds), which the engine parses against the same schema.
 */
object RdmaShuffleConf {

  /** Prefix of every setting of this plugin. */
  val Prefix = "spark.shuffle.rdma."

  /** `false` hands every shuffle to Spark's sort shuffle. */
  val EnabledKey: String = Prefix + "enabled"

  /** Where the engine listens (default: the executor's host). */
  val BindHostKey: String = Prefix + "bindHost"

  /** The pool's cap; unset: derived from the native-memory bound. */
  val PoolCapKey: String = Prefix + "pool.capBytes"

  /** The engine's native-memory bound as a percentage of the memory overhead. */
  val OverheadPercentKey: String = Prefix + "memory.overheadPercent"

  /**
   * Parses and validates every declared setting.
   *
   * @throws RdmaShuffleConfigException naming the key, the value and what is allowed
   */
  def apply(conf: SparkConf): RdmaShuffleConf = {
    val values = SettingsSchema.all.map(s => s.key -> resolve(conf, s)).toMap
    val byKey = values.collect { case (k, Value(v)) => k -> v }
    checkCapHoldsLargestTier(byKey)
    val unknown = conf.getAll.map(_._1).filter(_.startsWith(Prefix))
      .filterNot(k => values.contains(k)).sorted.toSeq
    RdmaShuffleConf(
      byKey,
      values.collect { case (k, FromExecutorHost) => k }.toSet,
      conf.contains(BindHostKey),
      unknown)
  }

  /** A resolved setting. */
  private sealed trait Resolved

  /** Canonical value; empty for a setting that is unset. */
  private final case class Value(canonical: String) extends Resolved

  /** Not set: takes the executor's host, known only when the engine starts. */
  private case object FromExecutorHost extends Resolved

  private def resolve(conf: SparkConf, s: SettingSpec): Resolved = {
    val sparkKeys = s.key +: s.fallback.filterNot(_ == SettingsSchema.ExecutorHost)
    sparkKeys.find(conf.contains) match {
      case Some(from) =>
        Value(canonical(s, conf.get(from).trim, from))
      case None if s.fallback.contains(SettingsSchema.ExecutorHost) =>
        FromExecutorHost
      case None =>
        Value(s.default.map(d => canonical(s, d, "the default")).getOrElse(""))
    }
  }

  /**
   * The canonical form of `raw` for setting `s`, as the engine expects it.
   *
   * @param from where the value came from: `s.key`, a fallback key, or "the default"
   */
  private[rdma] def canonical(s: SettingSpec, raw: String, from: String): String = {
    val shown = if (from == s.key) s"${s.key}='$raw'" else s"$from='$raw' (used for ${s.key})"
    def fail(why: String): Nothing = throw new RdmaShuffleConfigException(s"$shown $why")
    def scalar(text: String): Long = s.kind match {
      case "size" | "sizes" =>
        try JavaUtils.byteStringAsBytes(text)
        catch {
          case NonFatal(_) => fail(s"is not a size ('$text'; examples: 65536, 64k, 16m)")
        }
      case "duration" =>
        try JavaUtils.timeStringAsMs(text)
        catch {
          case NonFatal(_) => fail(s"is not a duration ('$text'; examples: 500ms, 30s, 2min)")
        }
      case _ =>
        try text.trim.toLong
        catch {
          case _: NumberFormatException => fail("is not a non-negative integer")
        }
    }
    val (min, max) = s.range.filter(_ => s.kind != "choice").map { r =>
      val i = r.indexOf("..")
      def bound(b: String) = if (b.isEmpty) None else Some(scalar(b))
      (bound(r.substring(0, i)), bound(r.substring(i + 2)))
    }.getOrElse((None, None))
    def inRange(n: Long): Long = {
      if (min.exists(n < _) || max.exists(n > _)) fail(s"must be ${rangeText(s.kind, min, max)}")
      n
    }
    if (raw.isEmpty) {
      if (s.default.isEmpty) "" else fail("needs a value")
    } else {
      s.kind match {
        case "bool" =>
          raw.toLowerCase(Locale.ROOT) match {
            case b @ ("true" | "false") => b
            case _ => fail("must be true or false")
          }
        case "choice" =>
          val v = raw.toLowerCase(Locale.ROOT)
          if (!s.choices.contains(v)) fail(s"must be one of ${s.choices.mkString("|")}")
          v
        case "size" | "duration" | "int" =>
          inRange(scalar(raw)).toString
        case "sizes" =>
          val sizes = raw.split(",").map(_.trim).filter(_.nonEmpty).map(t => inRange(scalar(t)))
          if (sizes.isEmpty) fail("needs at least one size")
          if (sizes.zip(sizes.drop(1)).exists { case (a, b) => a >= b }) {
            fail(
              s"must list sizes in strictly ascending order (example: ${s.default.getOrElse("")})")
          }
          sizes.mkString(",")
        case "host" =>
          hostAddress(raw).getOrElse(fail("is not an address or a host name that resolves"))
        case _ =>
          raw
      }
    }
  }

  private def rangeText(kind: String, min: Option[Long], max: Option[Long]): String = {
    val unit = kind match {
      case "size" | "sizes" => " bytes"
      case "duration" => " ms"
      case _ => ""
    }
    (min, max) match {
      case (Some(lo), Some(hi)) => s"$lo..$hi$unit"
      case (Some(lo), None) => s"at least $lo$unit"
      case (None, Some(hi)) => s"at most $hi$unit"
      case _ => "any value"
    }
  }

  /** The IP address `host` resolves to (as Spark's own transport would bind it). */
  private[rdma] def hostAddress(host: String): Option[String] =
    try Some(InetAddress.getByName(host).getHostAddress)
    catch { case NonFatal(_) => None }

  private def checkCapHoldsLargestTier(values: Map[String, String]): Unit = {
    val capKey = Prefix + "pool.capBytes"
    val tiersKey = Prefix + "pool.tiers"
    for (cap <- values.get(capKey) if cap.nonEmpty; tiers <- values.get(tiersKey)
      if tiers.nonEmpty) {
      val largest = tiers.split(",").map(_.toLong).max
      if (cap.toLong < largest) {
        throw new RdmaShuffleConfigException(
          s"$capKey=$cap bytes is smaller than the largest pool tier ($largest bytes); raise " +
            s"$capKey or lower $tiersKey")
      }
    }
  }
}

/**
 * Resolved `spark.shuffle.rdma.*` settings (see the companion object).
 *
 * @param values        canonical value of every declared setting that is resolved now (empty
 *                      string: unset)
 * @param fromExecutorHost settings that take the executor's host, resolved in [[engineConfig]]
 * @param bindHostSet   whether the user set `spark.shuffle.rdma.bindHost`
 * @param unknownKeys   `spark.shuffle.rdma.*` keys in the Spark conf that the schema does not
 *                      declare (misspelt or obsolete); they are ignored
 */
final case class RdmaShuffleConf(
    values: Map[String, String],
    fromExecutorHost: Set[String],
    bindHostSet: Boolean,
    unknownKeys: Seq[String]) {

  import RdmaShuffleConf._

  /** Whether the plugin is enabled. */
  def enabled: Boolean = values(EnabledKey).toBoolean

  /** The canonical value of a declared setting resolved now (bytes, ms, lower-case words). */
  def apply(key: String): String =
    values.getOrElse(
      key,
      throw new NoSuchElementException(s"$key is not resolved without an " +
        "executor host, or not declared in settings/settings.tsv"))

  /** Whether the user set `spark.shuffle.rdma.pool.capBytes` (else it follows the bound). */
  def explicitPoolCap: Boolean = values.get(PoolCapKey).exists(_.nonEmpty)

  /**
   * The text `NativeBridge.memoryBudget` takes: every engine-scope setting resolved now and
   * Spark's memory settings (`sparkMemory`, [[NativeMemoryBound.settings]]). Settings that
   * follow the executor's host are left out (they do not touch memory, and no host is known
   * yet).
   */
  def budgetConfig(sparkMemory: Seq[(String, String)]): String =
    (SettingsSchema.all.filter(s => s.forEngine && !fromExecutorHost.contains(s.key))
      .map(s => s.key -> apply(s.key)) ++ sparkMemory).map { case (k, v) => s"$k=$v" }
      .mkString("", "\n", "\n")

  /** [[engineConfig]] without a native-memory bound (engines opened outside Spark, tests). */
  def engineConfig(
      executorId: String,
      appId: String,
      authSecret: Option[String],
      executorHost: String): String =
    engineConfig(executorId, appId, authSecret, executorHost, Nil)

  /** The bind host the user set, as an address; `None` when it follows the executor's host. */
  def explicitBindHost: Option[String] = if (bindHostSet) values.get(BindHostKey) else None

  /** One warning per unknown key, naming the nearest declared key. */
  def unknownKeyWarnings: Seq[String] = unknownKeys.map { k =>
    s"$k is not a setting of the RDMA shuffle plugin and is ignored; did you mean " +
      s"${SettingsSchema.nearest(k)}? (every setting is listed in the plugin README's " +
      "settings table)"
  }

  /**
   * The text handed to `NativeBridge.engineOpen`: every engine-scope setting of the schema as
   * `key=value` (canonical; empty when unset), then the executor id, the app id and, when
   * authentication is on, the secret.
   *
   * @param executorId   this executor's id (`driver` in local mode)
   * @param appId        the application id
   * @param authSecret   the app's `spark.authenticate` secret when authentication is on
   * @param executorHost the executor's host as Spark knows it (the default of the settings
   *                     whose fallback is the executor's host, e.g. `bindHost`)
   * @param sparkMemory  Spark's memory settings the engine's native-memory bound is computed
   *                     from ([[NativeMemoryBound.settings]])
   * @throws RdmaShuffleConfigException when the executor host does not resolve, or a value
   *                                    contains a line break (it would corrupt the line format)
   */
  def engineConfig(
      executorId: String,
      appId: String,
      authSecret: Option[String],
      executorHost: String,
      sparkMemory: Seq[(String, String)]): String = {
    val settings = SettingsSchema.all.filter(_.forEngine).map { s =>
      if (fromExecutorHost.contains(s.key)) {
        s.key -> RdmaShuffleConf.canonical(s, executorHost, "the executor's host")
      } else {
        s.key -> apply(s.key)
      }
    }
    val lines = settings ++ Seq("spark.executor.id" -> executorId, "spark.app.id" -> appId) ++
      sparkMemory ++
      authSecret.toSeq.flatMap(s =>
        Seq("spark.authenticate" -> "true", "spark.authenticate.secret" -> s))
    lines.foreach { case (k, v) =>
      if (k.exists(c => c == '\n' || c == '\r' || c == '=') || v.exists(c =>
          c == '\n' || c == '\r')) {
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
