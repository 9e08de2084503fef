/*
 * Licensed under the Apache License, Version 2.0.
 */
package rdmashuffle.yarn;

import java.nio.ByteBuffer;
import java.util.Collections;
import java.util.HashMap;
import java.util.Map;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.yarn.server.api.ApplicationInitializationContext;
import org.apache.hadoop.yarn.server.api.ApplicationTerminationContext;
import org.apache.hadoop.yarn.server.api.AuxiliaryService;
import org.apache.spark.network.TransportContext;
import org.apache.spark.network.server.TransportServer;
import org.apache.spark.network.shuffle.ExternalBlockHandler;
import org.apache.spark.network.util.MapConfigProvider;
import org.apache.spark.network.util.TransportConf;

/**
 * The NodeManager's {@code spark_shuffle} auxiliary service for tests/yarn when Spark's own
 * ({@code org.apache.spark.network.yarn.YarnShuffleService} of the {@code spark-network-yarn}
 * jar) cannot be had: that jar is not served by the package registry this project's CI reaches.
 *
 * <p>It runs Spark's external shuffle service itself: Spark's {@code ExternalBlockHandler}
 * (from {@code spark-network-shuffle}, the same class Spark's YARN service and the standalone
 * worker's service run) on a {@code TransportServer} at {@code spark.shuffle.service.port}. Every
 * message executors send (RegisterExecutor with their local directories, OpenBlocks,
 * FetchShuffleBlocks, GetLocalDirsForExecutors, RemoveBlocks) is handled by Spark's code; this
 * class only ties it to YARN's application lifecycle. Not done here, as not needed by the tests:
 * {@code spark.authenticate} secrets (the application's secret travels in the container's service
 * data), recovery across NodeManager restarts, metrics, push-based shuffle merging.
 */
public class SparkShuffleAuxService extends AuxiliaryService {
  private ExternalBlockHandler handler;
  private TransportServer server;

  public SparkShuffleAuxService() {
    super("spark_shuffle");
  }

  @Override
  protected void serviceInit(Configuration conf) throws Exception {
    Map<String, String> spark = new HashMap<>();
    for (Map.Entry<String, String> e : conf) {
      if (e.getKey().startsWith("spark.")) spark.put(e.getKey(), e.getValue());
    }
    TransportConf transport = new TransportConf("shuffle", new MapConfigProvider(spark));
    handler = new ExternalBlockHandler(transport, null);
    int port = conf.getInt("spark.shuffle.service.port", 7337);
    TransportContext context = new TransportContext(transport, handler, true);
    server = context.createServer(port, Collections.emptyList());
    System.err.println("SPARK_SHUFFLE_AUX_SERVICE started on port " + server.getPort()
        + " (Spark's ExternalBlockHandler)");
    super.serviceInit(conf);
  }

  @Override
  protected void serviceStop() throws Exception {
    if (server != null) server.close();
    if (handler != null) handler.close();
    super.serviceStop();
  }

  @Override
  public void initializeApplication(ApplicationInitializationContext context) {
    System.err.println("SPARK_SHUFFLE_AUX_SERVICE application " + context.getApplicationId());
  }

  @Override
  public void stopApplication(ApplicationTerminationContext context) {
    // YARN deletes the application's directories itself.
    handler.applicationRemoved(context.getApplicationId().toString(), false);
  }

  @Override
  public ByteBuffer getMetaData() {
    return ByteBuffer.allocate(0);
  }
}
