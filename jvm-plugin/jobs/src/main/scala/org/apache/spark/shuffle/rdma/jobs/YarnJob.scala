/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma.jobs

import java.io.File

import org.apache.spark.sql.SparkSession

/**
 * The two applications of tests/yarn, each several of the other jobs in one application: on a
 * YARN cluster, starting an application (its application master, its executors' containers)
 * costs more than the jobs themselves. Like the jobs it runs, it knows nothing of the plugin.
 *
 * Usage: `YarnJob jobs <gateDir> <scale>` or `YarnJob service <gateDir>`.
 *
 *  - `jobs` (2 executors, no external shuffle service): [[ShuffleJobs]]' word count, TeraSort
 *    and AQE SQL job at `scale`, then [[FaultJob]]'s `during_reduce.kill9` (the harness kills an
 *    executor once reducers on two executors have read their first record).
 *  - `service` (dynamic allocation beside the external shuffle service, from 0 executors, at
 *    most 2): [[ElasticJob]]'s `service` mode (every executor released between the map stages
 *    and the last stage, which reads the departed executors' outputs from the service), then
 *    [[FaultJob]]'s `during_reduce.kill9` on executors dynamic allocation brings in for it.
 *
 * The lines printed are those of the jobs it runs; the application fails if a result is wrong.
 */
object YarnJob {

  /** The FaultJob scenario both applications run. */
  val KillScenario = "during_reduce.kill9"

  def main(args: Array[String]): Unit = {
    val usage = "usage: YarnJob jobs <gateDir> <scale> | YarnJob service <gateDir>"
    require(args.length >= 2, usage)
    val gateDir = args(1)
    require(new File(gateDir).isDirectory, s"gate directory $gateDir does not exist")
    val spark = SparkSession.builder().appName(s"rdma-shuffle-yarn-${args(0)}").getOrCreate()
    val sc = spark.sparkContext
    val wrong = args(0) match {
      case "jobs" =>
        require(args.length == 3, usage)
        ShuffleJobs.run(spark, Seq("wordcount", "terasort", "sql"), args(2).toDouble)
        FaultJob.run(sc, gateDir, Seq(KillScenario), executors = 2)
      case "service" =>
        require(args.length == 2, usage)
        val elastic = if (ElasticJob.run(sc, "service")) Nil else Seq("service")
        elastic ++ FaultJob.run(sc, gateDir, Seq(KillScenario), executors = 0, mapsAwaitPeers = 1)
      case other => throw new IllegalArgumentException(s"unknown application '$other'; $usage")
    }
    spark.stop()
    if (wrong.nonEmpty)
      throw new IllegalStateException(
        s"YarnJob ${args(0)}: wrong results in ${wrong.mkString(", ")}")
  }
}
