/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

import java.io.DataOutputStream;
import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;
import java.net.ServerSocket;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.Random;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Drives the real native library through every {@link NativeBridge} export, in a JVM of its own
 * that {@link NativeBridgeJniTest} starts with {@code -Xcheck:jni}.
 *
 * <p>Why a separate JVM: {@code -Xcheck:jni} must be on from JVM start, and its complaints are
 * printed by HotSpot (not thrown), so the only way to fail on them is to read the JVM's output.
 * This class therefore checks behaviour itself, exits non-zero on the first mismatch, and prints
 * {@link #OK_MARKER} when everything passed; the JUnit side checks exit code, marker and the
 * absence of JNI warnings.
 *
 * <p>Two engines in one JVM (A serves, B fetches) talk over tcp on 127.0.0.1, so the fetch
 * callbacks arrive on B's native threads, attached to this JVM as daemons: exactly the situation
 * of an executor.
 *
 * <p>Usage: {@code NativeBridgeJniScenario <scratch dir>}.
 */
public final class NativeBridgeJniScenario {
  /** Printed as the last line of stdout when every step passed. */
  public static final String OK_MARKER = "JNI_SCENARIO_OK";

  /** Bound on any single wait for callbacks; a hung fetch fails the scenario, not CI. */
  private static final long WAIT_SECONDS = 60;

  private static final int SHUFFLE = 3;

  private NativeBridgeJniScenario() {}

  /** One map output written in Spark's format, with the bytes kept for comparison. */
  private static final class MapOutput {
    final long mapId;
    final File data;
    final File index;
    final byte[] bytes;
    final long[] offsets;

    MapOutput(long mapId, File data, File index, byte[] bytes, long[] offsets) {
      this.mapId = mapId;
      this.data = data;
      this.index = index;
      this.bytes = bytes;
      this.offsets = offsets;
    }

    int numPartitions() {
      return offsets.length - 1;
    }

    /** The bytes of reduce partitions {@code [start, end)}: one contiguous range. */
    byte[] range(int start, int end) {
      return Arrays.copyOfRange(bytes, (int) offsets[start], (int) offsets[end]);
    }
  }

  /** What one index of a fetchBlocks call produced. */
  private static final class Outcome {
    final byte[] bytes;
    final long lease;
    final String kind;
    final String message;

    Outcome(byte[] bytes, long lease, String kind, String message) {
      this.bytes = bytes;
      this.lease = lease;
      this.kind = kind;
      this.message = message;
    }

    boolean ok() {
      return kind == null;
    }
  }

  /**
   * Collects outcomes; checks the "exactly one call per index" contract and the shape of every
   * buffer while it is still valid (inside onBlock).
   */
  private static class Collector implements FetchCallback {
    final int n;
    final Map<Integer, Outcome> outcomes = new ConcurrentHashMap<>();
    final CountDownLatch done;
    final List<String> violations = java.util.Collections.synchronizedList(new ArrayList<String>());
    final Map<String, Integer> threads = new ConcurrentHashMap<>();

    Collector(int n) {
      this.n = n;
      this.done = new CountDownLatch(n);
    }

    private void record(int index, Outcome o) {
      threads.merge(Thread.currentThread().getName(), 1, Integer::sum);
      if (index < 0 || index >= n) {
        violations.add("callback for index " + index + " of a " + n + "-block request");
      } else if (outcomes.putIfAbsent(index, o) != null) {
        violations.add("second callback for index " + index);
      }
      done.countDown();
    }

    @Override
    public void onBlock(int index, ByteBuffer buf, long lease) {
      if (buf == null || !buf.isDirect()) {
        violations.add("index " + index + ": not a direct buffer: " + buf);
        record(index, new Outcome(new byte[0], lease, null, null));
        return;
      }
      if (buf.position() != 0 || buf.limit() != buf.capacity()) {
        violations.add("index " + index + ": buffer position " + buf.position() + " limit "
            + buf.limit() + " capacity " + buf.capacity());
      }
      byte[] copy = new byte[buf.remaining()];
      buf.duplicate().get(copy);
      afterCopy(index, lease);
      record(index, new Outcome(copy, lease, null, null));
    }

    /** Hook for collectors that release (or misbehave) inside the callback. */
    void afterCopy(int index, long lease) {}

    @Override
    public void onFailure(int index, String kind, String message) {
      if (kind == null || kind.isEmpty() || message == null || message.isEmpty()) {
        violations.add("index " + index + ": failure without kind/message: " + kind + " / "
            + message);
      }
      record(index, new Outcome(null, 0L, kind, message));
    }

    Collector await(String what) throws InterruptedException {
      check(done.await(WAIT_SECONDS, TimeUnit.SECONDS), what + ": only "
          + (n - done.getCount()) + " of " + n + " callbacks within " + WAIT_SECONDS + " s");
      // A duplicate could still be in flight right after the latch opened; give it a moment.
      Thread.sleep(50);
      check(violations.isEmpty(), what + ": " + violations);
      check(outcomes.size() == n, what + ": " + outcomes.size() + " outcomes for " + n + " blocks");
      return this;
    }

    Outcome get(int i) {
      return outcomes.get(i);
    }
  }

  private static int steps = 0;

  private static void check(boolean cond, String what) {
    if (!cond) {
      throw new AssertionError(what);
    }
  }

  private static void step(String name) {
    steps++;
    System.out.println("step " + steps + ": " + name);
  }

  /**
   * Entry point.
   *
   * @param args the scratch directory
   */
  public static void main(String[] args) {
    int rc;
    try {
      run(new File(args[0]));
      System.out.println(OK_MARKER + " steps=" + steps);
      rc = 0;
    } catch (Throwable t) {
      System.out.println("JNI_SCENARIO_FAILED at step " + steps + ": " + t);
      t.printStackTrace(System.out);
      rc = 1;
    }
    System.out.flush();
    // Engine threads are daemons, but exit explicitly so the exit code is ours.
    System.exit(rc);
  }

  private static String config(String executorId) {
    return "spark.shuffle.rdma.transport=tcp\n"
        + "spark.shuffle.rdma.bindHost=127.0.0.1\n"
        + "spark.shuffle.rdma.port=0\n"
        + "spark.shuffle.rdma.eagerThreshold=65536\n"
        + "spark.shuffle.rdma.pool.capBytes=" + (64 << 20) + "\n"
        + "spark.shuffle.rdma.connectTimeout=10000\n"
        + "spark.shuffle.rdma.fetchTimeout=30000\n"
        + "spark.executor.id=" + executorId + "\n"
        + "spark.app.id=jni-scenario\n"
        + "a.key.the.engine.does.not.know=ignored\n";
  }

  /** Writes {@code shuffle_S_M_0.data} / {@code .index} as Spark's IndexShuffleBlockResolver does. */
  private static MapOutput writeMapOutput(File dir, long mapId, int[] sizes, long seed,
      boolean writeData) throws IOException {
    long[] offsets = new long[sizes.length + 1];
    for (int i = 0; i < sizes.length; i++) {
      offsets[i + 1] = offsets[i] + sizes[i];
    }
    byte[] bytes = new byte[(int) offsets[sizes.length]];
    new Random(seed).nextBytes(bytes);
    File data = new File(dir, "shuffle_" + SHUFFLE + "_" + mapId + "_0.data");
    File index = new File(dir, "shuffle_" + SHUFFLE + "_" + mapId + "_0.index");
    if (writeData) {
      try (FileOutputStream out = new FileOutputStream(data)) {
        out.write(bytes);
      }
    }
    try (DataOutputStream out = new DataOutputStream(new FileOutputStream(index))) {
      for (long o : offsets) {
        out.writeLong(o); // big-endian, as Spark writes it
      }
    }
    return new MapOutput(mapId, data, index, bytes, offsets);
  }

  /** Starts a fetch of the given ranges and waits for every callback. */
  private static Collector fetch(long h, int port, Collector c, int[] shuffles, long[] maps,
      int[] starts, int[] ends, String what) throws InterruptedException {
    NativeBridge.fetchBlocks(h, "127.0.0.1", port, shuffles, maps, starts, ends, c);
    return c.await(what);
  }

  private static int[] fill(int n, int v) {
    int[] a = new int[n];
    Arrays.fill(a, v);
    return a;
  }

  private static long[] fill(int n, long v) {
    long[] a = new long[n];
    Arrays.fill(a, v);
    return a;
  }

  /** {@code key=value} lines as a map (the value may be empty). */
  private static Map<String, String> keyValues(String text) {
    Map<String, String> m = new HashMap<>();
    for (String line : text.split("\n")) {
      int eq = line.indexOf('=');
      if (eq > 0) {
        m.put(line.substring(0, eq), line.substring(eq + 1));
      }
    }
    return m;
  }

    private static Map<String, Long> stats(long h) {
    Map<String, Long> m = new HashMap<>();
    String text = NativeBridge.engineStats(h);
    check(text != null && !text.isEmpty(), "engineStats returned nothing");
    for (String line : text.split("\n")) {
      int eq = line.indexOf('=');
      if (eq > 0) {
        try {
          m.put(line.substring(0, eq).trim(), Long.parseLong(line.substring(eq + 1).trim()));
        } catch (NumberFormatException e) {
          // transport=tcp and the like: not a counter.
        }
      }
    }
    for (String k : new String[] {"blocks_served", "bytes_served", "blocks_fetched",
        "bytes_fetched", "pool_bytes_in_use", "map_outputs_registered"}) {
      check(m.containsKey(k), "engineStats has no " + k + ":\n" + text);
    }
    return m;
  }

  /** Asserts that {@code body} throws RdmaShuffleException of {@code kind}. */
  private static RdmaShuffleException expect(String kind, String what, Runnable body) {
    try {
      body.run();
    } catch (RdmaShuffleException e) {
      check(kind.equals(e.kind()), what + ": kind " + e.kind() + ", expected " + kind + " (" + e
          + ")");
      check(e.getMessage() != null && !e.getMessage().isEmpty(), what + ": no message");
      return e;
    } catch (Throwable t) {
      throw new AssertionError(what + ": threw " + t + " instead of RdmaShuffleException[" + kind
          + "]", t);
    }
    throw new AssertionError(what + ": did not throw (expected RdmaShuffleException[" + kind
        + "])");
  }

  private static void run(File dir) throws Exception {
    step("load the native library");
    NativeLoader.Outcome loaded = NativeLoader.load();
    check(loaded.isLoaded(), "native library did not load: " + loaded.failure());
    System.out.println("  loaded from " + loaded.source());

    step("engineOpen x2 (tcp on 127.0.0.1)");
    final long a = NativeBridge.engineOpen(config("A"));
    final long b = NativeBridge.engineOpen(config("B"));
    check(a != 0 && b != 0 && a != b, "handles " + a + ", " + b);
    final int portA = NativeBridge.enginePort(a);
    final int portB = NativeBridge.enginePort(b);
    check(portA > 0 && portB > 0 && portA != portB, "ports " + portA + ", " + portB);
    check("tcp".equals(NativeBridge.engineTransport(a)), "transport " + NativeBridge.engineTransport(a));
    check("tcp".equals(NativeBridge.engineTransport(b)), "transport " + NativeBridge.engineTransport(b));
    System.out.println("  A port " + portA + ", B port " + portB);

    step("write and register Spark-format map outputs on A");
    // Sizes cover empty blocks, eager blocks (<= 64 KiB threshold) and rendezvous blocks.
    final MapOutput mixed = writeMapOutput(dir, 7, new int[] {17, 0, 4096, 70000, 1 << 20, 3, 0,
        65536}, 7, true);
    int[] small = new int[200];
    Random r = new Random(8);
    for (int i = 0; i < small.length; i++) {
      small[i] = i % 10 == 0 ? 0 : 1 + r.nextInt(300);
    }
    final MapOutput many = writeMapOutput(dir, 8, small, 8, true);
    // Spark writes no data file when every partition is empty; registration must accept that.
    final MapOutput empty = writeMapOutput(dir, 9, new int[] {0, 0, 0, 0}, 9, false);
    for (MapOutput m : new MapOutput[] {mixed, many, empty}) {
      NativeBridge.registerMapOutput(a, SHUFFLE, m.mapId, m.data.getAbsolutePath(),
          m.index.getAbsolutePath(), m.numPartitions());
    }
    check(stats(a).get("map_outputs_registered") == 3, "A stats after register: " + stats(a));

    long blocks = 0;
    long bytes = 0;

    step("single-block fetches B <- A, leases released on this thread");
    int n = mixed.numPartitions();
    int[] starts = new int[n];
    int[] ends = new int[n];
    for (int i = 0; i < n; i++) {
      starts[i] = i;
      ends[i] = i + 1;
    }
    Collector single = fetch(b, portA, new Collector(n), fill(n, SHUFFLE), fill(n, 7L), starts,
        ends, "single blocks");
    // The buffers must still hold the right bytes after the callbacks returned: read them again
    // only through the copies (the contract allows the memory to be reused after release).
    for (int i = 0; i < n; i++) {
      Outcome o = single.get(i);
      check(o.ok(), "block " + i + " failed: [" + o.kind + "] " + o.message);
      check(Arrays.equals(mixed.range(i, i + 1), o.bytes), "block " + i + ": " + o.bytes.length
          + " bytes differ from the " + (mixed.offsets[i + 1] - mixed.offsets[i]) + " written");
      blocks++;
      bytes += o.bytes.length;
    }
    check(stats(b).get("pool_bytes_in_use") > 0, "leases held, yet pool_bytes_in_use is 0");
    System.gc(); // a dangling reference to the callback or a buffer would show up now
    for (int i = 0; i < n; i++) {
      NativeBridge.releaseLease(single.get(i).lease);
    }
    System.out.println("  callback threads: " + single.threads);

    step("batch (multi-partition) fetches");
    int[] bs = {0, 2, 5, 0, 0};
    int[] be = {8, 5, 6, 200, 4};
    long[] bm = {7, 7, 7, 8, 8};
    Collector batch = fetch(b, portA, new Collector(bs.length), fill(bs.length, SHUFFLE), bm, bs,
        be, "batch");
    for (int i = 0; i < bs.length; i++) {
      Outcome o = batch.get(i);
      check(o.ok(), "batch " + i + " failed: [" + o.kind + "] " + o.message);
      MapOutput src = bm[i] == 7 ? mixed : many;
      check(Arrays.equals(src.range(bs[i], be[i]), o.bytes), "batch " + i + " bytes differ");
      NativeBridge.releaseLease(o.lease);
      blocks++;
      bytes += o.bytes.length;
    }

    step("many small blocks, leases released inside the callback on the engine's thread");
    // 200 callbacks (x3 rounds) on the same few attached native threads: each callback's local
    // references must be freed, or -Xcheck:jni reports the leak ("JNI local refs ... exceeds").
    for (int round = 0; round < 3; round++) {
      int m = many.numPartitions();
      int[] ms = new int[m];
      int[] me = new int[m];
      for (int i = 0; i < m; i++) {
        ms[i] = i;
        me[i] = i + 1;
      }
      Collector releasing = new Collector(m) {
        @Override
        void afterCopy(int index, long lease) {
          NativeBridge.releaseLease(lease);
        }
      };
      fetch(b, portA, releasing, fill(m, SHUFFLE), fill(m, 8L), ms, me, "many, round " + round);
      for (int i = 0; i < m; i++) {
        Outcome o = releasing.get(i);
        check(o.ok(), "many " + i + " failed: [" + o.kind + "] " + o.message);
        check(Arrays.equals(many.range(i, i + 1), o.bytes), "many " + i + " bytes differ");
        blocks++;
        bytes += o.bytes.length;
      }
    }

    step("engineStats counters after the successful fetches");
    Map<String, Long> sa = stats(a);
    Map<String, Long> sb = stats(b);
    System.out.println("  A " + sa + "\n  B " + sb);
    check(sb.get("blocks_fetched") == blocks, "B blocks_fetched " + sb.get("blocks_fetched")
        + ", expected " + blocks);
    check(sb.get("bytes_fetched") == bytes, "B bytes_fetched " + sb.get("bytes_fetched")
        + ", expected " + bytes);
    check(sa.get("blocks_served") == blocks, "A blocks_served " + sa.get("blocks_served")
        + ", expected " + blocks);
    check(sa.get("bytes_served") == bytes, "A bytes_served " + sa.get("bytes_served")
        + ", expected " + bytes);
    check(sb.get("pool_bytes_in_use") == 0, "every lease released, yet B pool_bytes_in_use "
        + sb.get("pool_bytes_in_use"));
    check(sa.get("blocks_fetched") == 0 && sb.get("blocks_served") == 0,
        "only B fetched and only A served");

    step("a callback that throws: the engine releases the buffer and keeps working");
    Collector throwing = new Collector(3) {
      @Override
      void afterCopy(int index, long lease) {
        throw new IllegalStateException("test: onBlock throws for index " + index);
      }

      @Override
      public void onFailure(int index, String kind, String message) {
        super.onFailure(index, kind, message);
        throw new IllegalStateException("test: onFailure throws for index " + index);
      }
    };
    // Two good blocks (one rendezvous, one eager) and one failing (unknown map output).
    NativeBridge.fetchBlocks(b, "127.0.0.1", portA, fill(3, SHUFFLE), new long[] {7, 7, 4242},
        new int[] {4, 0, 0}, new int[] {5, 1, 1}, throwing);
    // The throwing onBlock never records; only the failure counts down. Wait for the counters.
    long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(WAIT_SECONDS);
    while (stats(b).get("blocks_fetched") < blocks + 2 || stats(b).get("pool_bytes_in_use") != 0) {
      check(System.nanoTime() < deadline, "throwing callback: B stats " + stats(b));
      Thread.sleep(20);
    }
    // Only the failure records (the throwing onBlock returns before it): 3 - 1 = 2 left.
    while (throwing.done.getCount() != 2) {
      check(System.nanoTime() < deadline, "throwing callback: onFailure never came");
      Thread.sleep(20);
    }
    check(throwing.violations.isEmpty(), "throwing callback: " + throwing.violations);
    blocks += 2;
    bytes += (1 << 20) + 17;
    // The engine still serves afterwards.
    Collector after = fetch(b, portA, new Collector(1), new int[] {SHUFFLE}, new long[] {7},
        new int[] {2}, new int[] {3}, "after throwing callback");
    check(after.get(0).ok() && Arrays.equals(mixed.range(2, 3), after.get(0).bytes),
        "fetch after a throwing callback");
    NativeBridge.releaseLease(after.get(0).lease);
    blocks++;
    bytes += 4096;

    step("onBlock releases its lease, then throws; leases released twice or never issued");
    // Before lease handles were table keys, the bridge released the buffer a second time after
    // the throw (a double free: the pool's free list then held one buffer twice).
    final long[] releasedInside = new long[4];
    Collector releaseThenThrow = new Collector(4) {
      @Override
      void afterCopy(int index, long lease) {
        releasedInside[index] = lease;
        NativeBridge.releaseLease(lease);
        throw new IllegalStateException("test: onBlock released, then throws for " + index);
      }
    };
    NativeBridge.fetchBlocks(b, "127.0.0.1", portA, fill(4, SHUFFLE), fill(4, 7L),
        new int[] {0, 2, 3, 4}, new int[] {1, 3, 4, 5}, releaseThenThrow);
    deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(WAIT_SECONDS);
    while (stats(b).get("blocks_fetched") < blocks + 4) {
      check(System.nanoTime() < deadline, "release-then-throw: B stats " + stats(b));
      Thread.sleep(20);
    }
    Thread.sleep(100); // the bridge's handling of the throw runs after the counter moved
    blocks += 4;
    bytes += 17 + 4096 + 70000 + (1 << 20);
    check(stats(b).get("pool_bytes_in_use") == 0, "release-then-throw: pool_bytes_in_use "
        + stats(b).get("pool_bytes_in_use"));
    for (long l : releasedInside) {
      check(l != 0, "release-then-throw: a block came without a lease");
      check(!NativeBridge.releaseLease(l), "a third release of " + l + " released something");
    }
    // Never issued: a no-op with a warning.
    check(!NativeBridge.releaseLease(123456789L) && !NativeBridge.releaseLease(-5L),
        "a never-issued handle released something");
    check(stats(b).get("pool_bytes_in_use") == 0, "stale releases changed pool_bytes_in_use: "
        + stats(b).get("pool_bytes_in_use"));
    // Hold eight 4 KiB blocks at once: each must be its own buffer. With a buffer on the free
    // list twice, two of them would share memory and the first copy would not survive.
    Collector held = fetch(b, portA, new Collector(8), fill(8, SHUFFLE), fill(8, 7L),
        fill(8, 2), fill(8, 3), "eight leases held at once");
    for (int i = 0; i < 8; i++) {
      check(held.get(i).ok() && Arrays.equals(mixed.range(2, 3), held.get(i).bytes),
          "held block " + i);
      blocks++;
      bytes += 4096;
    }
    long inUse = stats(b).get("pool_bytes_in_use");
    check(inUse >= 8 * 4096, "eight 4 KiB leases held, pool_bytes_in_use " + inUse);
    for (int i = 0; i < 8; i++) {
      check(NativeBridge.releaseLease(held.get(i).lease), "held lease " + i + " not released");
    }
    check(stats(b).get("pool_bytes_in_use") == 0, "after releasing the eight: "
        + stats(b).get("pool_bytes_in_use"));

    step("remote failures reach onFailure with their kind");
    // An index too short for its partition count is registered anyway (the server keeps it so
    // that every fetch says exactly what is wrong, and Spark recomputes the map task).
    NativeBridge.registerMapOutput(a, SHUFFLE, 10, mixed.data.getAbsolutePath(),
        mixed.index.getAbsolutePath(), 50);
    Collector bad = fetch(b, portA, new Collector(5),
        new int[] {99, SHUFFLE, SHUFFLE, SHUFFLE, SHUFFLE}, new long[] {7, 12345, 7, 7, 10},
        new int[] {0, 0, 5, 3, 0}, new int[] {1, 1, 20, 3, 1}, "remote failures");
    String[] expectedKinds = {"unknown_shuffle", "unknown_map_output", "bad_range", "bad_range",
        "corrupt"};
    for (int i = 0; i < expectedKinds.length; i++) {
      Outcome o = bad.get(i);
      check(!o.ok(), "bad request " + i + " succeeded");
      check(expectedKinds[i].equals(o.kind), "bad request " + i + ": kind " + o.kind
          + ", expected " + expectedKinds[i] + " (" + o.message + ")");
      System.out.println("  [" + o.kind + "] " + o.message);
    }
    // Nobody listens on a port we just closed: a connection failure, per block.
    int deadPort;
    try (ServerSocket s = new ServerSocket(0)) {
      deadPort = s.getLocalPort();
    }
    Collector refused = fetch(b, deadPort, new Collector(2), fill(2, SHUFFLE), fill(2, 7L),
        new int[] {0, 1}, new int[] {1, 2}, "connection refused");
    for (int i = 0; i < 2; i++) {
      check(!refused.get(i).ok(), "fetch from a dead port succeeded");
      System.out.println("  dead port: [" + refused.get(i).kind + "] " + refused.get(i).message);
    }

    step("fetchBlockToFile streams a block into a file (onFile with a long length), or fails");
    File streamedFile = new File(dir, "streamed.tmp");
    File missingFile = new File(dir, "missing.tmp");
    final long[] fileLength = {-1, -1};
    final String[] fileKind = {null, null};
    final CountDownLatch filesDone = new CountDownLatch(2);
    for (int i = 0; i < 2; i++) {
      final int k = i;
      FetchCallback cb = new FetchCallback() {
        @Override
        public void onBlock(int index, ByteBuffer buf, long lease) {
          NativeBridge.releaseLease(lease);
          fileKind[k] = "unexpected onBlock";
          filesDone.countDown();
        }

        @Override
        public void onFailure(int index, String kind, String message) {
          fileKind[k] = kind;
          System.out.println("  streamed failure: [" + kind + "] " + message);
          filesDone.countDown();
        }

        @Override
        public void onFile(int index, long length) {
          fileLength[k] = index == 0 ? length : -2;
          filesDone.countDown();
        }
      };
      NativeBridge.fetchBlockToFile(b, "127.0.0.1", portA, SHUFFLE, k == 0 ? 7 : 12345, 0, 8,
          (k == 0 ? streamedFile : missingFile).getAbsolutePath(), cb);
    }
    check(filesDone.await(WAIT_SECONDS, TimeUnit.SECONDS), "fetchBlockToFile: no answer");
    byte[] want = mixed.range(0, 8);
    check(fileLength[0] == want.length && fileKind[0] == null, "streamed: length " + fileLength[0]
        + " kind " + fileKind[0] + ", expected " + want.length);
    check(Arrays.equals(java.nio.file.Files.readAllBytes(streamedFile.toPath()), want),
        "streamed file differs from the map output's bytes");
    check("unknown_map_output".equals(fileKind[1]), "streaming an unknown map output: "
        + fileKind[1]);
    // The probe and the one range of the 1.2 MB block count as fetched ranges.
    blocks += 2;
    bytes += want.length;
    check(stats(b).get("streamed_blocks") == 1 && stats(b).get("streamed_bytes") == want.length,
        "B streamed counters " + stats(b));
    check(stats(b).get("pool_bytes_in_use") == 0, "after streaming: "
        + stats(b).get("pool_bytes_in_use"));
    streamedFile.delete();
    missingFile.delete();

    step("invalid arguments throw RdmaShuffleException with a kind");
    final int[] one = {SHUFFLE};
    final long[] oneMap = {7};
    final int[] zero = {0};
    final int[] oneEnd = {1};
    final Collector unused = new Collector(1);
    expect("invalid_argument", "arrays of different lengths", () -> NativeBridge.fetchBlocks(b,
        "127.0.0.1", portA, new int[] {SHUFFLE, SHUFFLE}, oneMap, zero, oneEnd, unused));
    expect("invalid_argument", "negative map id", () -> NativeBridge.fetchBlocks(b, "127.0.0.1",
        portA, one, new long[] {-1}, zero, oneEnd, unused));
    expect("invalid_argument", "port out of range", () -> NativeBridge.fetchBlocks(b,
        "127.0.0.1", 70000, one, oneMap, zero, oneEnd, unused));
    expect("invalid_argument", "null host", () -> NativeBridge.fetchBlocks(b, null, portA, one,
        oneMap, zero, oneEnd, unused));
    expect("invalid_argument", "null callback", () -> NativeBridge.fetchBlocks(b, "127.0.0.1",
        portA, one, oneMap, zero, oneEnd, null));
    expect("invalid_argument", "null block array", () -> NativeBridge.fetchBlocks(b, "127.0.0.1",
        portA, null, oneMap, zero, oneEnd, unused));
    expect("invalid_argument", "negative partition count", () -> NativeBridge.registerMapOutput(
        a, SHUFFLE, 10, mixed.data.getAbsolutePath(), mixed.index.getAbsolutePath(), -1));
    expect("invalid_argument", "null index path", () -> NativeBridge.registerMapOutput(a,
        SHUFFLE, 10, mixed.data.getAbsolutePath(), null, 8));
    expect("register", "missing index file", () -> NativeBridge.registerMapOutput(a, SHUFFLE, 10,
        mixed.data.getAbsolutePath(), new File(dir, "nope.index").getAbsolutePath(), 8));
    expect("config", "bad transport", () -> NativeBridge.engineOpen(
        "spark.shuffle.rdma.transport=infiniband\n"));
    expect("config", "authenticate without a secret", () -> NativeBridge.engineOpen(
        "spark.shuffle.rdma.transport=tcp\nspark.authenticate=true\n"));
    expect("invalid_argument", "null config", () -> NativeBridge.engineOpen(null));
    check(unused.outcomes.isEmpty(), "a rejected fetchBlocks still called back: "
        + unused.outcomes.keySet());
    check(stats(a).get("map_outputs_registered") == 4, "a refused registration changed the store");

    step("a zero handle throws [closed] instead of crashing");
    expect("closed", "enginePort(0)", () -> NativeBridge.enginePort(0));
    expect("closed", "engineTransport(0)", () -> NativeBridge.engineTransport(0));
    expect("closed", "engineStats(0)", () -> NativeBridge.engineStats(0));
    expect("closed", "unregisterShuffle(0)", () -> NativeBridge.unregisterShuffle(0, SHUFFLE));
    expect("closed", "registerMapOutput(0)", () -> NativeBridge.registerMapOutput(0, SHUFFLE, 7,
        mixed.data.getAbsolutePath(), mixed.index.getAbsolutePath(), 8));
    expect("closed", "fetchBlocks(0)", () -> NativeBridge.fetchBlocks(0, "127.0.0.1", portA, one,
        oneMap, zero, oneEnd, unused));
    NativeBridge.releaseLease(0); // an empty block's lease: a no-op
    NativeBridge.engineClose(0); // closing "nothing": a no-op

    step("NativeEngine.close() with a fetch in flight whose callback re-enters the engine");
    // A peer that accepts and never answers keeps the fetch pending; close() fails it, and the
    // failure reaches the callback on the engine's delivery thread, which close() joins. The
    // callback retries (as Spark's RetryingBlockTransferor does) and releases a lease from yet
    // another thread. Before the fix close() held the write lock while joining that thread,
    // which waited for the read lock: a deadlock.
    try (ServerSocket silent = new ServerSocket(0, 50,
        java.net.InetAddress.getByName("127.0.0.1"))) {
      final NativeEngine closing = NativeEngine$.MODULE$.open(config("E"));
      final CountDownLatch failed = new CountDownLatch(1);
      final java.util.concurrent.atomic.AtomicReference<String> retry =
          new java.util.concurrent.atomic.AtomicReference<>("no retry");
      closing.fetchBlocks("127.0.0.1", silent.getLocalPort(),
          NativeEngineTestSupport.ranges(SHUFFLE, 7L, 0, 1), new FetchCallback() {
            @Override
            public void onBlock(int index, ByteBuffer buf, long lease) {
              closing.releaseLease(lease);
            }

            @Override
            public void onFailure(int index, String kind, String message) {
              try {
                closing.fetchBlocks("127.0.0.1", silent.getLocalPort(),
                    NativeEngineTestSupport.ranges(SHUFFLE, 7L, 0, 1), this);
                retry.set("retry accepted");
              } catch (RdmaShuffleException e) {
                retry.set("retry refused: " + e.kind());
              }
              Thread releaser = new Thread(() -> closing.releaseLease(987654321L));
              releaser.start();
              try {
                releaser.join(5000);
              } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
              }
              failed.countDown();
            }
          });
      Thread.sleep(200); // the fetch is connected and waiting for the peer's handshake
      Thread closer = new Thread(closing::close, "closer");
      long t0 = System.nanoTime();
      closer.start();
      closer.join(TimeUnit.SECONDS.toMillis(8));
      long ms = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - t0);
      check(!closer.isAlive(), "NativeEngine.close() still running after " + ms
          + " ms with a fetch in flight (deadlock)");
      check(failed.await(5, TimeUnit.SECONDS), "the in-flight fetch never failed");
      check("retry refused: closed".equals(retry.get()), "retry during close: " + retry.get());
      System.out.println("  close returned in " + ms + " ms; " + retry.get());
    }

    step("a closed engine behind NativeEngine throws [closed] instead of reaching native code");
    // The companion's open(String): Scala emits no static forwarder for it because the class
    // itself has a member named `open` (its private flag).
    NativeEngine guarded = NativeEngine$.MODULE$.open(config("C"));
    check(guarded.port() > 0, "NativeEngine port");
    guarded.close();
    guarded.close(); // idempotent
    expect("closed", "NativeEngine.stats after close", guarded::stats);
    expect("closed", "NativeEngine.unregisterShuffle after close",
        () -> guarded.unregisterShuffle(SHUFFLE));

    step("failure counters");
    Map<String, Long> fa = stats(a);
    Map<String, Long> fb = stats(b);
    System.out.println("  A " + fa + "\n  B " + fb);
    check(fb.get("blocks_fetched") == blocks && fb.get("bytes_fetched") == bytes,
        "B fetched " + fb.get("blocks_fetched") + "/" + fb.get("bytes_fetched") + ", expected "
            + blocks + "/" + bytes);
    // 1 from the throwing test, 5 remote failures, 2 connection failures, 1 streamed.
    check(fb.get("failed_blocks_fetched") == 9, "B failed_blocks_fetched "
        + fb.get("failed_blocks_fetched") + ", expected 9");
    check(fa.get("failed_blocks_served") == 7, "A failed_blocks_served "
        + fa.get("failed_blocks_served") + ", expected 7");
    check(fb.get("pool_bytes_in_use") == 0, "B pool_bytes_in_use " + fb.get("pool_bytes_in_use"));

    step("unregisterShuffle");
    check(NativeBridge.unregisterShuffle(a, SHUFFLE) == 4, "unregister should count 4 outputs");
    check(NativeBridge.unregisterShuffle(a, SHUFFLE) == 0, "second unregister should count 0");
    check(NativeBridge.unregisterShuffle(a, -1) == 0, "negative shuffle id should count 0");
    check(stats(a).get("map_outputs_registered") == 0, "map outputs left after unregister");
    Collector gone = fetch(b, portA, new Collector(1), one, oneMap, zero, oneEnd,
        "after unregister");
    check("unknown_shuffle".equals(gone.get(0).kind), "fetch after unregister: ["
        + gone.get(0).kind + "] " + gone.get(0).message);

    step("the engine reads the JVM's settings as the JVM resolved them (one schema, two readers)");
    // Values with units and fallbacks, resolved by the JVM (RdmaShuffleConf, Spark's parsers),
    // parsed again by the engine (settings.rs); engineSettings echoes what the engine holds.
    org.apache.spark.SparkConf sparkConf = new org.apache.spark.SparkConf(false)
        .set("spark.shuffle.rdma.transport", "TCP")
        .set("spark.shuffle.rdma.eagerThreshold", "32k")
        .set("spark.shuffle.rdma.pool.tiers", "4k,1m")
        .set("spark.shuffle.rdma.pool.capBytes", "64m")
        .set("spark.shuffle.rdma.fetchTimeout", "2min")
        .set("spark.network.timeout", "45s")
        .set("spark.shuffle.rdma.recvBuffers", "128")
        .set("spark.shuffle.rdma.gidIndex", "3");
    String jvmText = RdmaShuffleConf$.MODULE$.apply(sparkConf).engineConfig("D", "jni-scenario",
        scala.Option.apply((String) null), "localhost");
    Map<String, String> jvmSide = keyValues(jvmText);
    long d = NativeBridge.engineOpen(jvmText);
    Map<String, String> nativeSide = keyValues(NativeBridge.engineSettings(d));
    NativeBridge.engineClose(d);
    int engineKeys = 0;
    scala.collection.Iterator<SettingSpec> specs = SettingsSchema$.MODULE$.all().iterator();
    while (specs.hasNext()) {
      SettingSpec spec = specs.next();
      if (spec.forEngine()) {
        engineKeys++;
        check(jvmSide.containsKey(spec.key()), "the JVM did not send " + spec.key());
        check(jvmSide.get(spec.key()).equals(nativeSide.get(spec.key())), spec.key()
            + ": the JVM sent '" + jvmSide.get(spec.key()) + "', the engine holds '"
            + nativeSide.get(spec.key()) + "'");
      }
    }
    check(nativeSide.size() == engineKeys, "the engine knows " + nativeSide.size()
        + " settings, the jar's schema declares " + engineKeys + " for it: " + nativeSide.keySet());
    check("32768".equals(nativeSide.get("spark.shuffle.rdma.eagerThreshold"))
        && "45000".equals(nativeSide.get("spark.shuffle.rdma.idleTimeout"))
        && "120000".equals(nativeSide.get("spark.shuffle.rdma.fetchTimeout")), "units: " + nativeSide);
    System.out.println("  " + engineKeys + " settings agree: " + nativeSide);

    step("engineClose");
    NativeBridge.engineClose(b);
    NativeBridge.engineClose(a);
    System.gc();
  }
}
