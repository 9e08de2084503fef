package rdmashuffle.bench;

import java.io.BufferedReader;
import java.io.File;
import java.io.IOException;
import java.io.InputStreamReader;
import java.nio.ByteBuffer;
import java.nio.channels.FileChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.nio.file.StandardOpenOption;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.Semaphore;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;

import org.apache.spark.network.TransportContext;
import org.apache.spark.network.buffer.FileSegmentManagedBuffer;
import org.apache.spark.network.buffer.ManagedBuffer;
import org.apache.spark.network.client.ChunkReceivedCallback;
import org.apache.spark.network.client.RpcResponseCallback;
import org.apache.spark.network.client.TransportClient;
import org.apache.spark.network.client.TransportClientFactory;
import org.apache.spark.network.server.NoOpRpcHandler;
import org.apache.spark.network.server.OneForOneStreamManager;
import org.apache.spark.network.server.RpcHandler;
import org.apache.spark.network.server.StreamManager;
import org.apache.spark.network.server.TransportServer;
import org.apache.spark.network.util.MapConfigProvider;
import org.apache.spark.network.util.TransportConf;

/**
 * Spark's own shuffle block transfer, driven by scripts/bench-engine.sh (through
 * {@code engine-bench run}) as the baseline the engine is compared with.
 *
 * <p>The server is what an executor's block manager does for the default shuffle: an RPC names
 * a map output's data and index files and a range of reduce partitions; the handler reads the
 * offsets from the index file (as Spark's {@code IndexShuffleBlockResolver} does), registers one
 * {@link FileSegmentManagedBuffer} per block as a stream with a {@link OneForOneStreamManager}
 * and answers with the stream id (as {@code NettyBlockRpcServer} does for {@code OpenBlocks}). The
 * client then fetches the blocks with {@link TransportClient#fetchChunk}, as
 * {@code OneForOneBlockFetcher} does. Blocks leave the server by Netty's file regions (sendfile),
 * exactly as in Spark without encryption.
 *
 * <p>Modes:
 * <ul>
 *   <li>{@code server}: prints {@code ready <port> io_mode=<mode> threads=<n>}, serves until its
 *       standard input closes.</li>
 *   <li>{@code client <port>}: prints {@code ready}, then reads one command per line and answers
 *       each with one line, {@code ok ...} or {@code error <why>}:
 *       <ul>
 *         <li>{@code bulk <window> <spec>...}: opens one stream per spec (the opening RPCs all
 *             sent at once), and fetches every block of every stream as soon as its stream is
 *             open, with at most {@code window} blocks in flight;
 *             answers {@code ok blocks=<n> bytes=<n> secs=<s>}.</li>
 *         <li>{@code window <inflight> <reps> <spec>}: {@code reps} times, opens the spec's
 *             stream and fetches its blocks with {@code inflight} in flight; same answer.</li>
 *         <li>{@code latency <samples> <spec>}: fetches the spec's blocks one at a time, a new
 *             stream whenever one is used up, and times each {@code fetchChunk} alone (the
 *             stream's opening RPC is not timed); answers {@code ok us=<a>,<b>,...}.</li>
 *       </ul>
 *       A spec is {@code <data file>|<index file>|<first partition>|<end partition>}.</li>
 * </ul>
 *
 * <p>Both sides use Spark's defaults for the {@code shuffle} module, except the Netty thread
 * counts, which are set as Spark sets them for an executor that owns every core of the machine
 * (min(cores, 8), {@code SparkTransportConf}).
 */
public final class NettyBlockBench {
  /** A fetch that makes no progress for this long fails the command. */
  private static final long STALL_NANOS = TimeUnit.SECONDS.toNanos(120);

  private NettyBlockBench() {}

  public static void main(String[] args) throws Exception {
    if (args.length == 1 && args[0].equals("server")) {
      server();
    } else if (args.length == 2 && args[0].equals("client")) {
      client(Integer.parseInt(args[1]));
    } else {
      System.err.println("usage: NettyBlockBench server | client <port>");
      System.exit(2);
    }
  }

  private static TransportConf conf() {
    String threads = Integer.toString(Math.min(Runtime.getRuntime().availableProcessors(), 8));
    Map<String, String> m = new HashMap<>();
    m.put("spark.shuffle.io.serverThreads", threads);
    m.put("spark.shuffle.io.clientThreads", threads);
    return new TransportConf("shuffle", new MapConfigProvider(m));
  }

  private static void println(String line) {
    System.out.println(line);
    System.out.flush();
  }

  // ------------------------------------------------------------------------------- server

  /** Reads offsets {@code start..=end} of a Spark index file (big-endian longs). */
  static long[] readOffsets(Path index, int start, int end) throws IOException {
    int n = end - start + 1;
    ByteBuffer buf = ByteBuffer.allocate(n * 8);
    try (FileChannel ch = FileChannel.open(index, StandardOpenOption.READ)) {
      long pos = (long) start * 8;
      while (buf.hasRemaining()) {
        int r = ch.read(buf, pos);
        if (r < 0) {
          throw new IOException(index + " ends before partition " + end + "'s offset");
        }
        pos += r;
      }
    }
    buf.flip();
    long[] off = new long[n];
    for (int i = 0; i < n; i++) {
      off[i] = buf.getLong();
      if (i > 0 && off[i] < off[i - 1]) {
        throw new IOException(index + ": offsets decrease at partition " + (start + i));
      }
    }
    return off;
  }

  private static void server() throws Exception {
    TransportConf conf = conf();
    OneForOneStreamManager streams = new OneForOneStreamManager();
    RpcHandler handler = new RpcHandler() {
      @Override
      public void receive(TransportClient client, ByteBuffer message, RpcResponseCallback callback) {
        try {
          String[] f = StandardCharsets.UTF_8.decode(message).toString().split("\\|");
          if (f.length != 4) {
            throw new IllegalArgumentException("expected data|index|start|end, got " + f.length + " fields");
          }
          File data = new File(f[0]);
          int start = Integer.parseInt(f[2]);
          int end = Integer.parseInt(f[3]);
          if (start < 0 || end <= start) {
            throw new IllegalArgumentException("empty or negative partition range " + start + ".." + end);
          }
          long[] off = readOffsets(Path.of(f[1]), start, end);
          List<ManagedBuffer> blocks = new ArrayList<>(end - start);
          for (int i = 0; i < end - start; i++) {
            blocks.add(new FileSegmentManagedBuffer(conf, data, off[i], off[i + 1] - off[i]));
          }
          long id = streams.registerStream("bench", blocks.iterator(), client.getChannel());
          ByteBuffer reply = ByteBuffer.allocate(12);
          reply.putLong(id).putInt(blocks.size()).flip();
          callback.onSuccess(reply);
        } catch (Exception e) {
          callback.onFailure(e);
        }
      }

      @Override
      public StreamManager getStreamManager() {
        return streams;
      }
    };
    try (TransportContext ctx = new TransportContext(conf, handler);
         TransportServer server = ctx.createServer("127.0.0.1", 0, List.of())) {
      println("ready " + server.getPort() + " io_mode=" + conf.ioMode() + " threads=" + conf.serverThreads());
      // Serve until the driver closes our standard input (or dies).
      while (System.in.read() != -1) {
        // nothing to read but the end
      }
    }
  }

  // ------------------------------------------------------------------------------- client

  /** An opened stream: its id and number of blocks. */
  private record Opened(long streamId, int blocks) {}

  /**
   * Sends the RPC that opens a stream over a spec's blocks; the answer completes the future.
   * Several may be in flight at once, as Spark sends several fetch requests at once.
   */
  private static CompletableFuture<Opened> openAsync(TransportClient client, String spec) {
    if (spec.split("\\|").length != 4) {
      throw new IllegalArgumentException("bad spec '" + spec + "': expected data|index|start|end");
    }
    CompletableFuture<Opened> f = new CompletableFuture<>();
    client.sendRpc(ByteBuffer.wrap(spec.getBytes(StandardCharsets.UTF_8)), new RpcResponseCallback() {
      @Override
      public void onSuccess(ByteBuffer r) {
        f.complete(new Opened(r.getLong(), r.getInt()));
      }

      @Override
      public void onFailure(Throwable e) {
        f.completeExceptionally(e);
      }
    });
    return f;
  }

  private static Opened open(TransportClient client, String spec) throws Exception {
    return openAsync(client, spec).get(120, TimeUnit.SECONDS);
  }

  /** Fetches every block of {@code streams} in order, at most {@code window} in flight. */
  private static long[] fetchAll(TransportClient client, List<CompletableFuture<Opened>> streams, int window)
      throws Exception {
    Semaphore slots = new Semaphore(window);
    AtomicLong bytes = new AtomicLong();
    AtomicLong done = new AtomicLong();
    AtomicReference<Throwable> failure = new AtomicReference<>();
    ChunkReceivedCallback cb = new ChunkReceivedCallback() {
      @Override
      public void onSuccess(int chunkIndex, ManagedBuffer buffer) {
        // The buffer is released by Spark's response handler once this returns, as in
        // Spark's own fetcher when a consumer is done with the block.
        bytes.addAndGet(buffer.size());
        done.incrementAndGet();
        slots.release();
      }

      @Override
      public void onFailure(int chunkIndex, Throwable e) {
        failure.compareAndSet(null, e);
        done.incrementAndGet();
        slots.release();
      }
    };
    long total = 0;
    for (CompletableFuture<Opened> f : streams) {
      Opened s = f.get(120, TimeUnit.SECONDS);
      for (int i = 0; i < s.blocks(); i++) {
        awaitSlots(slots, 1, done, failure);
        client.fetchChunk(s.streamId(), i, cb);
        total++;
      }
    }
    awaitSlots(slots, window, done, failure);
    slots.release(window);
    return new long[] {total, bytes.get()};
  }

  /** Takes {@code n} permits, failing on a fetch failure or when nothing completes for 120 s. */
  private static void awaitSlots(Semaphore slots, int n, AtomicLong done, AtomicReference<Throwable> failure)
      throws Exception {
    long last = done.get();
    long since = System.nanoTime();
    while (!slots.tryAcquire(n, 1, TimeUnit.SECONDS)) {
      if (failure.get() != null) {
        break;
      }
      long now = done.get();
      if (now != last) {
        last = now;
        since = System.nanoTime();
      } else if (System.nanoTime() - since > STALL_NANOS) {
        throw new IOException("fetch stalled: no block completed for 120 s");
      }
    }
    Throwable f = failure.get();
    if (f != null) {
      throw new IOException("a block fetch failed: " + f, f);
    }
  }

  private static String run(TransportClient client, String[] w) throws Exception {
    switch (w[0]) {
      case "bulk": {
        int window = Integer.parseInt(w[1]);
        long t0 = System.nanoTime();
        List<CompletableFuture<Opened>> streams = new ArrayList<>();
        for (int i = 2; i < w.length; i++) {
          streams.add(openAsync(client, w[i]));
        }
        long[] r = fetchAll(client, streams, window);
        double secs = (System.nanoTime() - t0) / 1e9;
        return "ok blocks=" + r[0] + " bytes=" + r[1] + " secs=" + secs;
      }
      case "window": {
        int inflight = Integer.parseInt(w[1]);
        int reps = Integer.parseInt(w[2]);
        long blocks = 0;
        long bytes = 0;
        long t0 = System.nanoTime();
        for (int k = 0; k < reps; k++) {
          long[] r = fetchAll(client, List.of(openAsync(client, w[3])), inflight);
          blocks += r[0];
          bytes += r[1];
        }
        double secs = (System.nanoTime() - t0) / 1e9;
        return "ok blocks=" + blocks + " bytes=" + bytes + " secs=" + secs;
      }
      case "latency": {
        int samples = Integer.parseInt(w[1]);
        StringBuilder us = new StringBuilder();
        Opened s = null;
        int next = 0;
        for (int k = 0; k < samples; k++) {
          if (s == null || next == s.blocks()) {
            s = open(client, w[2]);
            next = 0;
          }
          long t0 = System.nanoTime();
          one(client, s.streamId(), next++);
          double micros = (System.nanoTime() - t0) / 1e3;
          if (k > 0) {
            us.append(',');
          }
          us.append(String.format("%.1f", micros));
        }
        return "ok us=" + us;
      }
      default:
        throw new IllegalArgumentException("unknown command '" + w[0] + "'");
    }
  }

  /** Fetches one chunk and waits for it. */
  private static void one(TransportClient client, long streamId, int chunk) throws Exception {
    Semaphore got = new Semaphore(0);
    AtomicReference<Throwable> failure = new AtomicReference<>();
    client.fetchChunk(streamId, chunk, new ChunkReceivedCallback() {
      @Override
      public void onSuccess(int chunkIndex, ManagedBuffer buffer) {
        got.release();
      }

      @Override
      public void onFailure(int chunkIndex, Throwable e) {
        failure.set(e);
        got.release();
      }
    });
    if (!got.tryAcquire(120, TimeUnit.SECONDS)) {
      throw new IOException("chunk " + chunk + " of stream " + streamId + " did not arrive in 120 s");
    }
    if (failure.get() != null) {
      throw new IOException("chunk " + chunk + " failed: " + failure.get(), failure.get());
    }
  }

  private static void client(int port) throws Exception {
    TransportConf conf = conf();
    try (TransportContext ctx = new TransportContext(conf, new NoOpRpcHandler());
         TransportClientFactory factory = ctx.createClientFactory()) {
      TransportClient client = factory.createClient("127.0.0.1", port);
      println("ready io_mode=" + conf.ioMode() + " threads=" + conf.clientThreads());
      BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
      String line;
      while ((line = in.readLine()) != null) {
        line = line.trim();
        if (line.isEmpty()) {
          continue;
        }
        try {
          println(run(client, line.split(" ")));
        } catch (Exception e) {
          println("error " + e.toString().replace('\n', ' '));
        }
      }
    }
  }
}
