/*
 * Licensed under the Apache License, Version 2.0.
 */
package org.apache.spark.shuffle.rdma;

import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.net.URL;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;
import java.util.Locale;

/**
 * Loads the native engine library {@code librdma_shuffle_jni.so} once per JVM.
 *
 * <p>Order: {@code System.loadLibrary("rdma_shuffle_jni")} (so an operator can put a build of
 * their own on {@code java.library.path}); else the copy bundled in the plugin jar at
 * {@code /org/apache/spark/shuffle/rdma/native/<os>/<arch>/librdma_shuffle_jni.so} is extracted
 * to a temporary file and loaded from there ({@code System.load} needs a real file).
 *
 * <p>The outcome is cached: a JVM tries once, and a failure is remembered with both attempts'
 * reasons, so the shuffle manager can log one clear warning and fall back to Spark's own
 * shuffle without paying for the attempt again.
 */
public final class NativeLoader {
  /** The library name without {@code lib} prefix and {@code .so} suffix. */
  public static final String LIB_NAME = "rdma_shuffle_jni";

  /** Where bundled libraries live in the jar, before {@code <os>/<arch>/<file>}. */
  public static final String RESOURCE_ROOT = "/org/apache/spark/shuffle/rdma/native";

  /** Suffix of the tcp-only build of the library, tried when the verbs build cannot load. */
  public static final String TCP_SUFFIX = "_tcp";

  /** How one attempt turned out. */
  public static final class Outcome {
    private final boolean loaded;
    private final String source;
    private final String failure;

    private Outcome(boolean loaded, String source, String failure) {
      this.loaded = loaded;
      this.source = source;
      this.failure = failure;
    }

    /**
     * An outcome made by hand, for tests that stand in for the native library.
     *
     * @param loaded whether the library counts as loaded
     * @param source where it came from
     * @param failure why it failed, or null
     * @return the outcome
     */
    static Outcome of(boolean loaded, String source, String failure) {
      return new Outcome(loaded, source, failure);
    }

    /** @return whether the library is loaded in this JVM */
    public boolean isLoaded() {
      return loaded;
    }

    /** @return where the library came from ("java.library.path" or the extracted file), or null */
    public String source() {
      return source;
    }

    /** @return why loading failed (both attempts' reasons), or null when loaded */
    public String failure() {
      return failure;
    }
  }

  /** The two ways of loading, separated so tests can observe them without a real library. */
  interface Loader {
    /** Mirrors {@link System#loadLibrary(String)}. */
    void loadLibrary(String name);

    /** Mirrors {@link System#load(String)}. */
    void load(String absolutePath);

    /** Looks a resource up in the plugin jar, null when absent. */
    URL resource(String path);
  }

  private static final Loader SYSTEM = new Loader() {
    @Override
    public void loadLibrary(String name) {
      System.loadLibrary(name);
    }

    @Override
    public void load(String absolutePath) {
      System.load(absolutePath);
    }

    @Override
    public URL resource(String path) {
      return NativeLoader.class.getResource(path);
    }
  };

  private static volatile Outcome cached;

  private NativeLoader() {}

  /**
   * Loads the library unless this JVM already tried; never throws.
   *
   * @return the (cached) outcome
   */
  public static Outcome load() {
    Outcome o = cached;
    if (o == null) {
      synchronized (NativeLoader.class) {
        o = cached;
        if (o == null) {
          o = attempt(SYSTEM, osName(System.getProperty("os.name")),
              archName(System.getProperty("os.arch")));
          cached = o;
        }
      }
    }
    return o;
  }

  /**
   * One load attempt with explicit collaborators; {@link #load()} caches its result.
   *
   * @param loader how to load and where to look for resources
   * @param os normalised OS name (see {@link #osName})
   * @param arch normalised architecture (see {@link #archName})
   * @return the outcome
   */
  static Outcome attempt(Loader loader, String os, String arch) {
    String fromPath;
    try {
      loader.loadLibrary(LIB_NAME);
      return new Outcome(true, "java.library.path", null);
    } catch (Throwable t) {
      // UnsatisfiedLinkError (not found, wrong ELF class, missing symbols) or SecurityException.
      fromPath = t.toString();
    }
    // The jar bundles two builds: with the verbs provider (needs libibverbs.so.1) and tcp-only.
    // Where RDMA user space is missing the first cannot load, and the second still gives the
    // engine over tcp instead of Spark's built-in shuffle.
    StringBuilder why = new StringBuilder("not on java.library.path (" + fromPath + ")");
    for (String variant : new String[] {LIB_NAME, LIB_NAME + TCP_SUFFIX}) {
      String resource = resourcePath(os, arch, variant);
      URL url = loader.resource(resource);
      if (url == null) {
        why.append("; the plugin jar has no ").append(resource)
            .append(" (a jar built without the native library, or an unsupported platform ")
            .append(os).append("/").append(arch).append(")");
        continue;
      }
      Path tmp = null;
      try {
        tmp = Files.createTempFile("lib" + variant + "-", ".so");
        File f = tmp.toFile();
        f.deleteOnExit();
        try (InputStream in = url.openStream()) {
          Files.copy(in, tmp, StandardCopyOption.REPLACE_EXISTING);
        }
        loader.load(f.getAbsolutePath());
        // Once mapped, the library no longer needs its file: delete it now, or every killed
        // executor would leave a copy behind in the temp directory (deleteOnExit needs a clean
        // exit).
        Files.deleteIfExists(tmp);
        return new Outcome(true, f.getAbsolutePath(), null);
      } catch (IOException | RuntimeException | LinkageError e) {
        if (tmp != null) {
          try {
            Files.deleteIfExists(tmp);
          } catch (IOException ignored) {
            // deleteOnExit still removes it later.
          }
        }
        why.append("; loading the bundled ").append(resource).append(" failed: ").append(e);
      }
    }
    return new Outcome(false, null, why.toString());
  }

  /**
   * @param os normalised OS name
   * @param arch normalised architecture
   * @return the jar resource path of the bundled (verbs-enabled) library for that platform
   */
  public static String resourcePath(String os, String arch) {
    return resourcePath(os, arch, LIB_NAME);
  }

  /**
   * @param os normalised OS name
   * @param arch normalised architecture
   * @param variant library name without prefix and suffix
   * @return the jar resource path of that library for that platform
   */
  public static String resourcePath(String os, String arch, String variant) {
    return RESOURCE_ROOT + "/" + os + "/" + arch + "/" + System.mapLibraryName(variant);
  }


  /**
   * Maps {@code os.name} to the folder names used in the jar (Rust's target OS names).
   *
   * @param osName value of {@code os.name}
   * @return linux, macos, windows, or the lower-cased name with spaces removed
   */
  public static String osName(String osName) {
    String n = osName == null ? "unknown" : osName.toLowerCase(Locale.ROOT);
    if (n.startsWith("linux")) {
      return "linux";
    } else if (n.startsWith("mac") || n.startsWith("darwin")) {
      return "macos";
    } else if (n.startsWith("windows")) {
      return "windows";
    }
    return n.replace(" ", "");
  }

  /**
   * Maps {@code os.arch} to the folder names used in the jar (Rust's target arch names).
   *
   * @param arch value of {@code os.arch}
   * @return x86_64, aarch64, or the lower-cased value
   */
  public static String archName(String arch) {
    String a = arch == null ? "unknown" : arch.toLowerCase(Locale.ROOT);
    if (a.equals("amd64") || a.equals("x86_64") || a.equals("x64")) {
      return "x86_64";
    } else if (a.equals("aarch64") || a.equals("arm64")) {
      return "aarch64";
    }
    return a;
  }
}
