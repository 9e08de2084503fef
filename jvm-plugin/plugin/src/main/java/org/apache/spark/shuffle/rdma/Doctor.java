/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.io.PrintStream;
import java.nio.file.Files;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Properties;

/**
 * The preflight an operator runs on a node before Spark does, from the plugin jar alone (no
 * Spark or Scala on the class path):
 *
 * <pre>
 *   java -cp rdma-shuffle-spark4.x_2.13-0.1.0-SNAPSHOT.jar org.apache.spark.shuffle.rdma.Doctor [--json]
 *       [--transport auto|{@literal <provider>}] [--conf key=value]... [--properties-file FILE]
 * </pre>
 *
 * <p>It loads the engine the executors would load (the jar's native library) and prints the
 * node's RDMA devices, ports, port state, link layer and MTU; the GID table with each GID's
 * type, and which GID the engine would use and why; the engine's native-memory bound and the
 * memlock limit against what verbs would pin; whether registering the pool's memory works; a
 * loopback transfer of 1 MiB by SEND and by RDMA READ (over tcp where that is what runs) with
 * times; and what {@code transport=auto} picks and why.
 *
 * <p>Settings: {@code spark.shuffle.rdma.*} and Spark's memory settings (which the bound comes
 * from) from {@code --properties-file}, else {@code $SPARK_CONF_DIR/spark-defaults.conf} or
 * {@code $SPARK_HOME/conf/spark-defaults.conf} when present, then {@code --conf} on top.
 *
 * <p>Exit status: 0 when the transport asked for works on this node, 2 when it cannot (or the
 * native library does not load), 1 for bad arguments.
 */
public final class Doctor {
  private Doctor() {}

  /** Exit status when the transport asked for cannot work. */
  public static final int EXIT_UNUSABLE = 2;

  private static final String TRANSPORT_KEY = "spark.shuffle.rdma.transport";

  private static final String USAGE =
      "usage: java -cp <plugin jar> org.apache.spark.shuffle.rdma.Doctor [--json]\n"
          + "         [--transport auto|<provider>] [--conf key=value]... [--properties-file FILE]";

  public static void main(String[] args) {
    System.exit(run(args, System.getenv(), System.out, System.err));
  }

  /**
   * Runs the preflight.
   *
   * @param args the command line
   * @param env the environment ({@code SPARK_CONF_DIR}, {@code SPARK_HOME})
   * @param out where the report goes
   * @param err where problems with the command itself go
   * @return the exit status
   */
  static int run(String[] args, Map<String, String> env, PrintStream out, PrintStream err) {
    boolean json = false;
    String propertiesFile = null;
    Map<String, String> conf = new LinkedHashMap<>();
    for (int i = 0; i < args.length; i++) {
      String a = args[i];
      switch (a) {
        case "--json":
          json = true;
          break;
        case "-h":
        case "--help":
          out.println(USAGE);
          return 0;
        case "--transport":
        case "--conf":
        case "--properties-file":
          if (i + 1 >= args.length) {
            err.println(a + " needs a value\n" + USAGE);
            return 1;
          }
          String v = args[++i];
          if (a.equals("--transport")) {
            conf.put(TRANSPORT_KEY, v);
          } else if (a.equals("--properties-file")) {
            propertiesFile = v;
          } else {
            int eq = v.indexOf('=');
            if (eq <= 0) {
              err.println("--conf takes key=value, got '" + v + "'\n" + USAGE);
              return 1;
            }
            conf.put(v.substring(0, eq).trim(), v.substring(eq + 1).trim());
          }
          break;
        default:
          err.println("unknown argument '" + a + "'\n" + USAGE);
          return 1;
      }
    }
    Map<String, String> settings = new LinkedHashMap<>();
    File file = propertiesFile != null ? new File(propertiesFile) : defaultsFile(env);
    if (file != null) {
      try (InputStream in = Files.newInputStream(file.toPath())) {
        Properties p = new Properties();
        p.load(in);
        for (String k : p.stringPropertyNames()) {
          settings.put(k, p.getProperty(k).trim());
        }
      } catch (IOException e) {
        if (propertiesFile != null) {
          err.println("cannot read " + file + ": " + e);
          return 1;
        }
      }
    }
    settings.putAll(conf);
    // The bound of an executor of these settings, with Spark's defaults for what is unset (a
    // config without any Spark memory setting would mean an engine outside Spark, unbounded).
    settings.putIfAbsent("spark.master", "");
    StringBuilder config = new StringBuilder();
    for (Map.Entry<String, String> e : settings.entrySet()) {
      String k = e.getKey();
      if (k.startsWith("spark.shuffle.rdma.") || SparkMemorySettings.isKey(k)) {
        if (e.getValue().indexOf('\n') >= 0) {
          err.println("setting " + k + " contains a line break");
          return 1;
        }
        config.append(k).append('=').append(e.getValue()).append('\n');
      }
    }

    NativeLoader.Outcome loaded = NativeLoader.load();
    if (!loaded.isLoaded()) {
      String why = "the native library lib" + NativeLoader.LIB_NAME + ".so does not load here ("
          + loaded.failure() + "): Spark would hand every shuffle to its own sort shuffle";
      if (json) {
        out.println("{\"ok\":false,\"exit_code\":" + EXIT_UNUSABLE + ",\"error\":\""
            + why.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n") + "\"}");
      } else {
        out.println("native        " + why);
        out.println("verdict       the engine cannot run on this node");
      }
      return EXIT_UNUSABLE;
    }
    if (!json) {
      out.println("native        " + loaded.source()
          + (file != null ? "; settings from " + file : "; no spark-defaults.conf found"));
    }
    String report;
    try {
      report = NativeBridge.doctor(config.toString(), json);
    } catch (RdmaShuffleException e) {
      err.println("bad setting: " + e.getMessage());
      return 1;
    }
    int nl = report.indexOf('\n');
    int code = Integer.parseInt(report.substring("exit=".length(), nl).trim());
    out.print(report.substring(nl + 1));
    out.flush();
    return code;
  }

  /** {@code $SPARK_CONF_DIR/spark-defaults.conf} or {@code $SPARK_HOME/conf/...}, if present. */
  private static File defaultsFile(Map<String, String> env) {
    String dir = env.get("SPARK_CONF_DIR");
    if (dir == null && env.get("SPARK_HOME") != null) {
      dir = env.get("SPARK_HOME") + File.separator + "conf";
    }
    if (dir == null) {
      return null;
    }
    File f = new File(dir, "spark-defaults.conf");
    return f.isFile() ? f : null;
  }
}
