/*
 * Licensed under the Apache License, Version 2.0.
 */
package rdmashuffle.yarn;

import java.io.File;
import java.io.FileOutputStream;
import java.io.OutputStream;
import java.nio.file.Files;
import java.util.Map;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.yarn.conf.YarnConfiguration;
import org.apache.hadoop.yarn.server.MiniYARNCluster;

/**
 * A real YARN cluster in one JVM for tests/yarn: Hadoop's MiniYARNCluster (a ResourceManager
 * and one NodeManager; containers are real child processes), as Spark's own YARN suite runs it.
 *
 * <p>Usage: {@code MiniYarn <work dir> <shuffle service port> <aux service class> [<aux
 * classpath>]}. The NodeManager enforces each container's physical memory (the check most
 * clusters run: pmem on, vmem off) and runs the {@code spark_shuffle} auxiliary service (class
 * and, if given, its isolated class path). Once up, it writes the cluster's configuration to
 * {@code <work dir>/conf/yarn-site.xml} (for HADOOP_CONF_DIR), prints {@code MINIYARN_READY
 * conf=<dir> logs=<container log dir>} and runs until its standard input closes.
 *
 * <p>One NodeManager: a second one in this JVM would start a second shuffle service on the same
 * port. Every container is on this host.
 */
public final class MiniYarn {
  public static void main(String[] args) throws Exception {
    if (args.length < 3) {
      throw new IllegalArgumentException(
          "usage: MiniYarn <work dir> <shuffle service port> <aux service class> [<aux classpath>]");
    }
    File work = new File(args[0]).getAbsoluteFile();
    YarnConfiguration conf = new YarnConfiguration();
    // The default CapacityScheduler needs a queue configuration; FIFO needs none.
    conf.set(YarnConfiguration.RM_SCHEDULER,
        "org.apache.hadoop.yarn.server.resourcemanager.scheduler.fifo.FifoScheduler");
    conf.setBoolean(YarnConfiguration.NM_PMEM_CHECK_ENABLED, true);
    conf.setBoolean(YarnConfiguration.NM_VMEM_CHECK_ENABLED, false);
    conf.setInt(YarnConfiguration.NM_CONTAINER_MON_INTERVAL_MS, 1000);
    conf.setInt(YarnConfiguration.RM_SCHEDULER_MINIMUM_ALLOCATION_MB, 128);
    conf.setInt(YarnConfiguration.RM_SCHEDULER_MAXIMUM_ALLOCATION_MB, 4096);
    conf.setInt(YarnConfiguration.NM_PMEM_MB, 6144);
    conf.setInt(YarnConfiguration.NM_VCORES, 8);
    // A shared, busy disk must not take the only NodeManager out of service.
    conf.setFloat(
        YarnConfiguration.NM_MAX_PER_DISK_UTILIZATION_PERCENTAGE, 100.0f);
    conf.setInt(YarnConfiguration.DEBUG_NM_DELETE_DELAY_SEC, 600);
    conf.set(YarnConfiguration.NM_AUX_SERVICES, "spark_shuffle");
    conf.set("yarn.nodemanager.aux-services.spark_shuffle.class", args[2]);
    if (args.length > 3 && !args[3].isEmpty()) {
      conf.set("yarn.nodemanager.aux-services.spark_shuffle.classpath", args[3]);
    }
    conf.set("spark.shuffle.service.port", args[1]);

    MiniYARNCluster cluster = new MiniYARNCluster("rdma-shuffle-yarn", 1, 1, 1);
    cluster.init(conf);
    cluster.start();
    long deadline = System.currentTimeMillis() + 120_000;
    while (cluster.getResourceManager().getRMContext().getRMNodes().size() < 1) {
      if (System.currentTimeMillis() > deadline) throw new IllegalStateException("no NodeManager");
      Thread.sleep(100);
    }
    // The effective configuration (the RM's real ports exist only now) for spark-submit.
    Configuration effective = cluster.getConfig();
    Configuration site = new Configuration(false);
    for (Map.Entry<String, String> e : effective) {
      String k = e.getKey();
      if (k.startsWith("yarn.") || k.startsWith("fs.") || k.startsWith("hadoop.")) {
        site.set(k, effective.get(k));
      }
    }
    File confDir = new File(work, "conf");
    Files.createDirectories(confDir.toPath());
    try (OutputStream out = new FileOutputStream(new File(confDir, "yarn-site.xml"))) {
      site.writeXml(out);
    }
    String logs = cluster.getNodeManager(0).getConfig().get(YarnConfiguration.NM_LOG_DIRS);
    System.out.println("MINIYARN_READY conf=" + confDir + " logs=" + logs);
    System.out.flush();
    // Run until the harness closes our standard input (or dies).
    while (System.in.read() >= 0) { }
    cluster.stop();
    System.out.println("MINIYARN_STOPPED");
  }
}
