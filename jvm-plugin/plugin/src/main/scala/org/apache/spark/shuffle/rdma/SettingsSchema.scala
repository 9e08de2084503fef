/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma

import java.io.InputStream
import java.nio.charset.StandardCharsets

/**
 * One declared `spark.shuffle.rdma.*` setting: a row of `settings/settings.tsv`.
 *
 * @param kind     `bool`, `choice`, `size`, `sizes`, `duration`, `int`, `host` or `string`
 * @param default  the value when neither the key nor a fallback is set; `None`: unset
 * @param fallback settings consulted, in order, before the default;
 *                 [[SettingsSchema.ExecutorHost]] stands for the executor's host
 * @param range    `a|b|c` for a choice, `min..max` for numbers (either end may be empty)
 * @param scope    `jvm` (read by the plugin only) or `engine` (handed to the native engine)
 */
final case class SettingSpec(
    key: String,
    kind: String,
    default: Option[String],
    fallback: Seq[String],
    range: Option[String],
    scope: String,
    doc: String) {

  /** Whether the native engine receives this setting. */
  def forEngine: Boolean = scope == "engine"

  /** The allowed words of a `choice`. */
  def choices: Seq[String] = if (kind == "choice") range.toSeq.flatMap(_.split('|')) else Nil
}

/**
 * The settings schema, `settings/settings.tsv` at the repository root, which Maven copies into
 * the jar next to this class. The native engine compiles in the same file, so both sides know
 * the same keys, defaults and ranges; nothing here repeats a default.
 */
object SettingsSchema {

  /** Where the schema is in the jar. */
  val ResourcePath = "/org/apache/spark/shuffle/rdma/settings.tsv"

  /** The fallback that stands for the executor's own host as Spark knows it. */
  val ExecutorHost = "@executorHost"

  private val Header = Seq("key", "type", "default", "fallback", "range", "scope", "doc")
  private val Kinds = Set("bool", "choice", "size", "sizes", "duration", "int", "host", "string")

  /** Every declared setting, in schema order. */
  lazy val all: Seq[SettingSpec] = {
    val in = getClass.getResourceAsStream(ResourcePath)
    if (in == null) {
      throw new IllegalStateException(s"$ResourcePath is missing from the plugin jar (the " +
        "build copies it from settings/settings.tsv); the jar is broken, rebuild it")
    }
    parse(read(in))
  }

  /** The declaration of `key`, if it is one. */
  def get(key: String): Option[SettingSpec] = all.find(_.key == key)

  private def read(in: InputStream): String =
    try scala.io.Source.fromInputStream(in, StandardCharsets.UTF_8.name()).mkString
    finally in.close()

  /**
   * Parses the schema text. Checks the shape (header, seven columns, known types and scopes,
   * unique prefixed keys); values are checked by [[RdmaShuffleConf]] when resolved.
   */
  def parse(text: String): Seq[SettingSpec] = {
    val rows = text.split("\n").toSeq.zipWithIndex
      .map { case (l, i) => (l.stripSuffix("\r"), i + 1) }
      .filterNot { case (l, _) => l.trim.isEmpty || l.startsWith("#") }
    require(
      rows.nonEmpty && rows.head._1.split("\t").toSeq == Header,
      s"settings schema: the first row must be the header ${Header.mkString("\\t")}")
    val specs = rows.tail.map { case (line, n) =>
      val c = line.split("\t", -1)
      require(
        c.length == Header.length,
        s"settings schema line $n: expected ${Header.length} tab-separated columns, got ${c.length}")
      def opt(s: String): Option[String] = if (s == "-") None else Some(s)
      require(Kinds.contains(c(1)), s"settings schema line $n: unknown type '${c(1)}'")
      require(
        c(5) == "jvm" || c(5) == "engine",
        s"settings schema line $n: unknown scope '${c(5)}'")
      require(
        c(0).startsWith(RdmaShuffleConf.Prefix),
        s"settings schema line $n: '${c(0)}' lacks the ${RdmaShuffleConf.Prefix} prefix")
      SettingSpec(
        c(0),
        c(1),
        opt(c(2)),
        opt(c(3)).toSeq.flatMap(_.split(',')),
        opt(c(4)),
        c(5),
        c(6))
    }
    val dup = specs.groupBy(_.key).collect { case (k, v) if v.size > 1 => k }
    require(dup.isEmpty, s"settings schema: duplicate keys ${dup.mkString(", ")}")
    specs
  }

  /** The declared key closest to `key` by edit distance (case-insensitive). */
  def nearest(key: String): String =
    all.map(_.key).minBy(k => editDistance(k.toLowerCase, key.toLowerCase))

  /** Levenshtein distance: insertions, deletions and substitutions of one character. */
  def editDistance(a: String, b: String): Int = {
    var prev = Array.tabulate(b.length + 1)(identity)
    for (i <- 1 to a.length) {
      val cur = new Array[Int](b.length + 1)
      cur(0) = i
      for (j <- 1 to b.length) {
        val sub = prev(j - 1) + (if (a.charAt(i - 1) == b.charAt(j - 1)) 0 else 1)
        cur(j) = math.min(sub, math.min(prev(j) + 1, cur(j - 1) + 1))
      }
      prev = cur
    }
    prev(b.length)
  }
}
